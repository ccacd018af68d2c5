"""SGLang's group formation, for tests of interop (issue 44): `init_custom_process_group` as
`sglang.srt.utils.common` defines it (itself a copy of OpenRLHF's and torch's), written here from
its source so our engine and our sender are tested against the ecosystem's convention, not ours.
Its trainer-side copies (OpenRLHF, SkyRL, open-instruct, PipelineRL) behave the same: a tcp://
rendezvous (`torch.distributed.rendezvous`: rank 0 hosts the TCPStore, every rank registers as a
worker), the store prefixed with `group_name`, `_new_process_group_helper`.

SGLang's engine calls it from `/init_weights_update_group` as
`init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
world_size=world_size, rank=rank_offset + tp_rank, group_name=group_name)` and receives each
tensor of `/update_weights_from_distributed` with `torch.distributed.broadcast(weight, src=0,
group=group)` into an empty tensor of the declared dtype and shape."""

from __future__ import annotations

import torch
from packaging import version as pkg_version

torch_release = pkg_version.parse(torch.__version__).release


def init_custom_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name=None,
    pg_options=None,
    device_id=None,
):
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    # (sglang.srt.utils.common: torch_release = pkg_version.parse(torch.__version__).release)
    pg_options_param_name = "backend_options" if torch_release >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,
        **{pg_options_param_name: pg_options},
        timeout=timeout,
        device_id=device_id,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
