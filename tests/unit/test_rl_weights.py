"""WeightStore on file:// and on s3:// against a real moto S3 server on loopback (a subprocess),
including the server dying mid-publish."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch

from s3util import free_port, make_bucket, s3_options, start_moto
from slipstream.storage import WeightStore
from slipstream.storage.safetensors_buffer import SafetensorsBuffer


def sd(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g)
    return {"a.weight": w, "b.weight": torch.randn(5, generator=g), "tied": w}


def check_roundtrip(store: WeightStore) -> None:
    assert store.latest() is None
    for v in range(5):
        store.publish(v, sd(v), config={"hidden_size": 3})
    assert store.versions() == [2, 3, 4]  # keep_last = 3
    got = store.fetch(3)
    assert torch.equal(got["a.weight"], sd(3)["a.weight"]) and torch.equal(
        got["tied"], sd(3)["tied"]
    )
    assert store.fetch_config(4) == {"hidden_size": 3}
    with pytest.raises(FileNotFoundError):
        store.fetch(0)


def test_file_store_roundtrip_and_partial_publish_invisible(tmp_path: Path) -> None:
    store = WeightStore(f"file://{tmp_path}/store", keep_last=3)
    check_roundtrip(store)
    # A publish that died after the weights but before the manifest: files without manifest.
    store.blob.put("weights/v00000005/model.safetensors", b"partial")
    assert store.latest() == 4
    store.publish(5, sd(5))  # same version again: overwrites the debris
    assert store.latest() == 5 and torch.equal(store.fetch(5)["b.weight"], sd(5)["b.weight"])
    out = store.fetch_to_dir(5, str(tmp_path / "hf"))
    assert (Path(out) / "model.safetensors").is_file()
    # what an engine server is told to load: the version's directory itself
    assert store.location(5) == str(tmp_path / "store" / "weights" / "v00000005")
    assert (Path(store.location(5)) / "model.safetensors").is_file()


class Proxy:
    """TCP forwarder in front of the S3 server; `kill()` drops every connection and the listener
    at once, which the client sees exactly like the server process dying (moto keeps its state in
    memory, so killing moto itself would also erase the debris this test wants to look at)."""

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def kill(self) -> None:
        # shutdown() first: close() alone does not wake a thread blocked in accept() on Linux,
        # and the socket would keep listening.
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for s in self.socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass


def test_s3_store_roundtrip(moto: int) -> None:
    make_bucket(moto)
    store = WeightStore("s3://bucket/run1", keep_last=3, storage_options=s3_options(moto))
    check_roundtrip(store)
    assert store.location(4) == "s3://bucket/run1/weights/v00000004"
    assert store.blob.fs.isfile(store.location(4) + "/model.safetensors")
    # a trainer's per-step publish hands over a SafetensorsBuffer (bytes for the S3 PUT)
    buf = SafetensorsBuffer.for_tensors(sd(5))
    buf.fill(sd(5))
    store.publish(5, buf)
    assert store.check(5) is None
    got = store.fetch(5)
    assert got.keys() == sd(5).keys() and all(torch.equal(got[k], sd(5)[k]) for k in got)


def test_s3_server_killed_mid_publish(moto: int) -> None:
    make_bucket(moto)
    proxy_port = free_port()
    proxy = Proxy(proxy_port, moto)
    writer = WeightStore("s3://bucket/run", keep_last=3, storage_options=s3_options(proxy_port))
    reader = WeightStore("s3://bucket/run", keep_last=3, storage_options=s3_options(moto))
    writer.publish(1, sd(1))

    real_put = writer.blob.put

    def put_then_die(rel: str, data: bytes) -> None:
        real_put(rel, data)
        if rel.endswith("model.safetensors"):
            proxy.kill()  # the server "dies" after the weights, before the manifest

    writer.blob.put = put_then_die  # type: ignore[method-assign]
    with pytest.raises(Exception) as info:  # noqa: B017 - botocore/aiohttp raise various types
        writer.publish(2, sd(2))
    print("publish failed with", repr(info.value))
    # The weights object of version 2 is on the server, its manifest is not: invisible.
    assert reader.blob.exists("weights/v00000002/model.safetensors")
    assert reader.versions() == [1] and reader.latest() == 1
    assert torch.equal(reader.fetch(1)["a.weight"], sd(1)["a.weight"])
    # The server comes back (same port); the next publish succeeds and overwrites the debris.
    proxy2 = Proxy(proxy_port, moto)
    writer2 = WeightStore("s3://bucket/run", keep_last=3, storage_options=s3_options(proxy_port))
    writer2.publish(2, sd(2))
    writer2.publish(3, sd(3))
    assert reader.versions() == [1, 2, 3]
    assert torch.equal(reader.fetch(2)["b.weight"], sd(2)["b.weight"])
    proxy2.kill()


def test_s3_moto_process_killed_mid_publish() -> None:
    """The real server process gets SIGKILL between the weights and the manifest: the publish
    fails loudly; a fresh server on the same port (moto keeps no state) takes the next publish,
    and readers only ever see complete versions."""
    port = free_port()
    proc = start_moto(port)
    try:
        make_bucket(port)
        store = WeightStore("s3://bucket/run", keep_last=3, storage_options=s3_options(port))
        real_put = store.blob.put

        def put_then_kill(rel: str, data: bytes) -> None:
            real_put(rel, data)
            if rel.endswith("model.safetensors"):
                proc.kill()
                proc.wait()

        store.blob.put = put_then_kill  # type: ignore[method-assign]
        with pytest.raises(Exception):  # noqa: B017 - botocore/aiohttp raise various types
            store.publish(1, sd(1))
        proc = start_moto(port)
        make_bucket(port)
        store2 = WeightStore("s3://bucket/run", keep_last=3, storage_options=s3_options(port))
        assert store2.versions() == []
        store2.publish(1, sd(1))
        assert store2.versions() == [1]
        assert torch.equal(store2.fetch(1)["a.weight"], sd(1)["a.weight"])
    finally:
        proc.kill()
        proc.wait()


def test_ckpt_export_writes_a_checkpoint_eval_can_load(tmp_path: Path) -> None:
    """`slipstream ckpt export` = the published weights + the run's tokenizer: what `eval
    --checkpoint` and `serve --model` load."""
    from slipstream.cli import main
    from slipstream.config.model import ModelConfig
    from slipstream.model import MoEForCausalLM, hf_weights, load_pretrained
    from slipstream.model.tokenizer import load_tokenizer

    torch.manual_seed(0)
    model = MoEForCausalLM(
        ModelConfig(
            vocab_size=99,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        )  # fmt: skip
    )
    store_url = (tmp_path / "store").as_uri()
    WeightStore(store_url).publish(7, *hf_weights(model))
    out = tmp_path / "export"
    assert main(["ckpt", "export", f"--store.url={store_url}", str(out)]) == 0
    assert (out / "tokenizer.json").is_file()
    assert load_tokenizer(out).vocab_size == 99
    loaded = load_pretrained(str(out))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
