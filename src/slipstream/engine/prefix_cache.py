"""A prefix cache across requests for the native engine: KV of token sequences the engine has
already computed, kept in a block pool so a later prompt that starts with them (the same GRPO
prompt sent again, a multi-turn episode resending its history) prefills only its new suffix.

Layout: `k_LBKtD` / `v_LBKtD`, a pool of `num_blocks` blocks of `block_tokens` positions each
(`engine.prefix_cache_tokens` // block_tokens blocks), beside the slot cache. A block is keyed by
(its parent block, its tokens): a chain of blocks is one cached prefix, and prefixes that share
their beginning share its blocks (a radix tree over block-sized edges, as SGLang's radix cache or
vLLM's block hashes, here with exact token keys instead of hashes). Only whole blocks are cached;
a lookup leaves at least one prompt token to prefill (its logits sample the first token).

- `lookup(prompt)` -> number of leading tokens cached (a multiple of block_tokens) and the
  blocks; `load` copies them into a slot of the slot cache (positions [0, hit)).
- `store(tokens, cache, slot, length)` copies the whole blocks of a slot's first `length`
  positions in, reusing the blocks already cached.
- Eviction: least recently used block first (a lookup touches its whole chain, so a parent is
  never older than its children); evicting a block drops its descendants (unreachable then).
- `worth_waiting(prompt, admitted)`: the scheduler holds a prompt back one step when one
  admitted in this step starts with the same block (identical prompts arriving together would
  otherwise all prefill in full).
- `clear()` on every weight update (KV of other weights would be wrong); `request_clear()` from
  another thread (HTTP /flush_cache) is applied at the engine thread's next use.
- Counters: `query_tokens` (prompt tokens looked up), `hit_tokens` (of them, served from cache).

Only the engine thread calls lookup/load/store/clear.

Models with Gated DeltaNet layers (qwen3_next, qwen3_5_moe): a GDN prefix is a state snapshot
at the prefix end, not pages. A cached chain then serves only up to its deepest block that holds
a snapshot (`_Block.snapshot`, a row of the slot cache's snapshot pool: every GDN layer's conv
window and recurrent state at that block's end); `load` copies the pages and puts the snapshot
into the slot. Snapshots are taken during an admission's prefill: `snapshot_point(prompt, hit)`
gives the last block boundary b before the prompt's last token (when past the hit) and reserves
a snapshot; the engine splits the prefill there (two `Part`s, the first with `snapshot` set) and
stores the prompt's blocks up to b with it. Finished sequences are not stored for these models
(their state is at the sequence end, not at a block boundary). Pool size: as many snapshots as
fit in the bytes of the K/V block pool (at least one); a full pool evicts the least recently
used block holding one (with its descendants). MLA models cache their expanded K/V blocks like
any attention (V narrower than K: the pools have each their own width).

Legend: L layers, B blocks, K kv heads, t block_tokens, D head dim, N slots, S slot length.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from slipstream.engine.kv_cache import SlotKVCache


@dataclass
class _Block:
    key: tuple[int, tuple[int, ...]]  # (parent block id or -1, tokens)
    children: set[int] = field(default_factory=set)
    snapshot: int = -1  # GDN models: the snapshot of the states at this block's end, or -1


class PrefixCache:
    """See the module docstring."""

    def __init__(self, slots: SlotKVCache, num_tokens: int, block_tokens: int = 16) -> None:
        if block_tokens < 1:
            raise ValueError(f"prefix cache block_tokens must be >= 1, got {block_tokens}")
        num_blocks = num_tokens // block_tokens
        if num_blocks < 1:
            raise ValueError(
                f"engine.prefix_cache_tokens={num_tokens} holds no block of {block_tokens} tokens"
            )
        num_layers, _, heads, _, head_dim = slots.k_LNKSD.shape
        shape = (num_layers, num_blocks, heads, block_tokens, head_dim)
        v_shape = (*shape[:-1], slots.v_LNKSD.shape[-1])  # MLA: V narrower than K
        dtype, device = slots.k_LNKSD.dtype, slots.k_LNKSD.device
        self.k_LBKtD = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LBKtD = torch.zeros(v_shape, dtype=dtype, device=device)
        self.slots = slots
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self._blocks: dict[int, _Block] = {}
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._clear_flag = threading.Event()
        self.query_tokens = 0
        self.hit_tokens = 0
        self.needs_snapshots = bool(slots.linear_layers)
        """GDN layers: a prefix serves only up to a block with a state snapshot."""
        self.num_snapshots = 0
        if self.needs_snapshots:  # as many as fit in the K/V block pool's bytes
            self.num_snapshots = max(1, self.nbytes // slots.bytes_per_slot()["linear"])
            slots.allocate_snapshots(self.num_snapshots)
        self._reserved: set[int] = set()  # snapshots handed out by snapshot_point, not stored
        self._free_snapshots = list(range(self.num_snapshots - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return self.k_LBKtD.nbytes + self.v_LBKtD.nbytes

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def request_clear(self) -> None:
        """Drop everything at the engine thread's next use (safe from any thread)."""
        self._clear_flag.set()

    def clear(self) -> None:
        self._blocks.clear()
        self._by_key.clear()
        self._lru.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        # a snapshot reserved now is being written by this step's forward: not free yet
        self._free_snapshots = [
            i for i in range(self.num_snapshots - 1, -1, -1) if i not in self._reserved
        ]
        self._clear_flag.clear()

    def _pending_clear(self) -> None:
        if self._clear_flag.is_set():
            self.clear()

    def _chunks(self, tokens: list[int], limit: int) -> list[tuple[int, ...]]:
        t = self.block_tokens
        return [tuple(tokens[i : i + t]) for i in range(0, limit - limit % t, t)]

    def lookup(self, prompt: list[int]) -> tuple[int, list[int]]:
        """(cached leading tokens, their blocks); leaves >= 1 prompt token uncached."""
        self._pending_clear()
        self.query_tokens += len(prompt)
        parent, found = -1, []
        for chunk in self._chunks(prompt, len(prompt) - 1):
            block = self._by_key.get((parent, chunk))
            if block is None:
                break
            found.append(block)
            parent = block
        if self.needs_snapshots:  # a GDN prefix ends where its states were saved
            while found and self._blocks[found[-1]].snapshot < 0:
                found.pop()
        for block in found:
            self._lru.move_to_end(block)
        hit = len(found) * self.block_tokens
        self.hit_tokens += hit
        return hit, found

    def worth_waiting(self, prompt: list[int], admitted: list[list[int]]) -> bool:
        """Whether `prompt` should wait one step because a prompt admitted in this step shares
        at least its first whole block: that prefill is stored right after the step, so the
        copies of a GRPO prompt sent as separate requests then prefill only their tail."""
        t = self.block_tokens
        if len(prompt) <= t:
            return False
        head = prompt[:t]
        return any(p[:t] == head for p in admitted)

    def load(self, blocks: list[int], slot: int) -> None:
        """Copy cached blocks into positions [0, len(blocks) * block_tokens) of `slot`."""
        if not blocks:
            return
        n, t = len(blocks), self.block_tokens
        index = torch.tensor(blocks, device=self.k_LBKtD.device)
        for pool, dst in ((self.k_LBKtD, self.slots.k_LNKSD), (self.v_LBKtD, self.slots.v_LNKSD)):
            layers, _, heads, _, dim = pool.shape
            blocks_LKnD = pool[:, index].permute(0, 2, 1, 3, 4).reshape(layers, heads, n * t, dim)
            dst[:, slot, :, : n * t] = blocks_LKnD
        if self.needs_snapshots:
            self.slots.load_snapshot(self._blocks[blocks[-1]].snapshot, slot)

    def snapshot_point(self, prompt: list[int], hit: int) -> tuple[int, int]:
        """GDN models: (b, snapshot) where b is the last block boundary before the prompt's last
        token and `snapshot` a reserved pool row for the states there, when b is past the hit
        (the engine then prefills [hit, b) as a `Part` with that snapshot, and `store`s the
        prompt up to b with it); else (0, -1)."""
        self._pending_clear()
        t = self.block_tokens
        b = (len(prompt) - 1) // t * t
        if not self.needs_snapshots or b <= hit:
            return 0, -1
        if not self._free_snapshots:
            victim = next((k for k in self._lru if self._blocks[k].snapshot >= 0), None)
            if victim is None:  # every snapshot reserved in this step
                return 0, -1
            self._evict(victim)
        snapshot = self._free_snapshots.pop()
        self._reserved.add(snapshot)
        return b, snapshot

    def release_reserved(self) -> None:
        """Free the snapshots `snapshot_point` handed out and no `store` took (a step that
        failed between them)."""
        self._free_snapshots.extend(sorted(self._reserved, reverse=True))
        self._reserved.clear()

    def store(self, tokens: list[int], slot: int, length: int, snapshot: int = -1) -> int:
        """Cache the whole blocks of `tokens[:length]`, whose KV is positions [0, length) of
        `slot`; returns the blocks newly written. GDN models: only with the `snapshot`
        (`snapshot_point`) of the states at `length`, a block boundary, kept by the last block
        (released when the chain could not be stored whole)."""
        self._pending_clear()
        self._reserved.discard(snapshot)
        if self.needs_snapshots and (snapshot < 0 or length % self.block_tokens):
            if snapshot >= 0:
                self._free_snapshots.append(snapshot)
            return 0
        parent, written = -1, 0
        t = self.block_tokens
        chunks = self._chunks(tokens, min(length, len(tokens)))
        for i, chunk in enumerate(chunks):
            key = (parent, chunk)
            block = self._by_key.get(key)
            if block is None:
                block = self._allocate(protect=parent)
                if block is None:
                    break  # everything else is this chain's own ancestry: stop here
                self._blocks[block] = _Block(key)
                self._by_key[key] = block
                if parent >= 0:
                    self._blocks[parent].children.add(block)
                for pool, src in ((self.k_LBKtD, self.slots.k_LNKSD),
                                  (self.v_LBKtD, self.slots.v_LNKSD)):  # fmt: skip
                    pool[:, block] = src[:, slot, :, i * t : (i + 1) * t]
                written += 1
            self._lru[block] = None
            self._lru.move_to_end(block)
            parent = block
            if snapshot >= 0 and i == len(chunks) - 1 and self._blocks[block].snapshot < 0:
                self._blocks[block].snapshot, snapshot = snapshot, -1
        if snapshot >= 0:  # not kept (chain cut short, or the block had one): free it
            self._free_snapshots.append(snapshot)
        return written

    def _allocate(self, protect: int) -> int | None:
        """A free block, evicting the least recently used (never `protect` or its ancestors:
        the chain being stored)."""
        if self._free:
            return self._free.pop()
        keep = set()
        b = protect
        while b >= 0:
            keep.add(b)
            b = self._blocks[b].key[0]
        victim = next((b for b in self._lru if b not in keep), None)
        if victim is None:
            return None
        self._evict(victim)
        return self._free.pop()

    def _evict(self, block: int) -> None:
        meta = self._blocks.pop(block)
        for child in list(meta.children):
            self._evict(child)
        del self._by_key[meta.key]
        self._lru.pop(block, None)
        if meta.snapshot >= 0:
            self._free_snapshots.append(meta.snapshot)
        parent = meta.key[0]
        if parent >= 0 and parent in self._blocks:
            self._blocks[parent].children.discard(block)
        self._free.append(block)
