"""KV cache blocks and the intrusive doubly linked free queue that orders their eviction."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """Metadata of one physical KV block of `block_size` token slots.

    `ref_cnt` counts holders (running requests and pins). `block_hash` is set while the block
    is registered in the prefix cache. `prev_free` / `next_free` are the links of the free queue
    and are only meaningful while `ref_cnt == 0`; they are owned by `FreeBlockQueue`.
    """

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        digest = None if self.block_hash is None else self.block_hash[:4].hex()
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted first (least recently freed).

    Intrusive doubly linked list between two sentinel nodes, so `popleft`, `append` and `remove`
    (a prefix hit taking a cached free block out of the middle) are all O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the block to evict next; raises ValueError when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} available")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Takes a block out of the middle of the queue (a prefix hit on a free block)."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Adds a block at the tail: it is evicted after every block already queued."""
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def _unlink(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def check_invariants(self) -> None:
        """Walks the list both ways: links agree, the count matches, members are unreferenced."""
        forward = list(self)
        assert len(forward) == self.num_free_blocks, "free queue count drifted"
        backward = []
        block = self._tail.prev_free
        while block is not None and block is not self._head:
            backward.append(block)
            block = block.prev_free
        assert backward[::-1] == forward, "free queue links disagree"
        for member in forward:
            assert member.ref_cnt == 0, f"{member} is referenced but in the free queue"
