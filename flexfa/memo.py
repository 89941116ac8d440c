"""Bounded in-process memos, and memos that forget an entry when a user's object dies.

Every cache in flexfa is one of these (or a dict cleared with them): ``BoundedMemo`` is an LRU
with a size bound; ``OwnedMemo`` keeps entries per owner object (a mod, a block mask) by
weak reference, so dropping the owner drops its entries and whatever they hold (captured
tensors, block-mask tables). ``clear_all`` empties every memo (tests, benchmarks).
"""
from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict

import torch

_ALL: "weakref.WeakSet" = weakref.WeakSet()
# memos emptied so far (any memo, by clear or clear_all): what a caller keeps of a memo's
# entries outside it (flexfa.prepared's plans) is used only while this is unchanged
CLEARS = 0


class BoundedMemo:
    """A dict-like LRU memo of at most ``size`` entries (the least recently used go first)."""

    def __init__(self, size: int, name: str = "", register: bool = True, on_evict=None):
        assert size > 0, size
        self.size, self.name = size, name
        self.on_evict = on_evict  # called with (key, value) of each entry the bound drops
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.RLock()
        if register:  # cleared by clear_all
            _ALL.add(self)

    def get(self, key, default=None):
        try:
            value = self._data[key]
        except KeyError:
            return default
        try:
            self._data.move_to_end(key)
        except KeyError:  # removed by another thread meanwhile
            pass
        return value

    def __getitem__(self, key):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key, value) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                dropped = self._data.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(*dropped)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def pop(self, key, default=None):
        with self._lock:
            return self._data.pop(key, default)

    def values(self):
        return list(self._data.values())

    def clear(self) -> None:
        global CLEARS
        with self._lock:
            CLEARS += 1
            self._data.clear()

    def __repr__(self) -> str:
        return f"BoundedMemo({self.name!r}, {len(self)}/{self.size})"


_MISSING = object()


# an owner's attribute holding its own entries ({OwnedMemo: BoundedMemo}), for owners that
# objects its entries refer to keep alive (``keep_on_owner``)
_ON_OWNER = "_flexfa_owned_memos"


def keep_on_owner(owner) -> None:
    """Keep every OwnedMemo's entries of ``owner`` on ``owner`` itself rather than in the
    memo. For an owner that its entries' own objects keep alive (a mask hung on its own
    table, whose plans bind that table): held by the memo, such entries would keep their
    owner alive for ever; held by the owner, they form a cycle the garbage collector frees
    once nothing else refers to it."""
    setattr(owner, _ON_OWNER, {})


def _own_entries(owner) -> dict | None:
    """The entries dict of an owner marked by ``keep_on_owner``, else None."""
    attributes = getattr(owner, "__dict__", None)
    return attributes.get(_ON_OWNER) if attributes is not None else None


class OwnedMemo:
    """Entries kept per owner object, which is held only weakly: when the owner is collected,
    its entries go with it. At most ``owners`` owners (least recently used dropped first) and
    ``per_owner`` entries each. Owners that cannot be weakly referenced are not memoized
    (``get`` misses, ``put`` does nothing). Owners marked by ``keep_on_owner`` hold their own
    entries (``per_owner`` at most per memo; cleared with the memo)."""

    def __init__(self, owners: int, per_owner: int, name: str = ""):
        self.name = name
        self.per_owner = per_owner
        self._owners = BoundedMemo(owners, name, register=False)  # id -> (weakref, memo)
        self._self_owners = weakref.WeakSet()  # owners holding their entries of this memo
        _ALL.add(self)

    def get(self, owner, key, default=None):
        own = _own_entries(owner)
        if own is not None:
            entries = own.get(self)
            return default if entries is None else entries.get(key, default)
        # the two memos' dicts read directly: this lookup is on every cached call's path
        owners = self._owners._data
        slot = owners.get(id(owner))
        if slot is None or slot[0]() is not owner:
            return default
        entries = slot[1]._data
        value = entries.get(key, _MISSING)
        if value is _MISSING:
            return default
        try:  # most recently used last (an entry removed by another thread meanwhile: done)
            owners.move_to_end(id(owner))
            entries.move_to_end(key)
        except KeyError:
            pass
        return value

    def put(self, owner, key, value) -> None:
        own = _own_entries(owner)
        if own is not None:
            if self not in own:
                own[self] = BoundedMemo(self.per_owner, self.name, register=False)
                self._self_owners.add(owner)
            own[self][key] = value
            return
        owner_id = id(owner)
        slot = self._owners.get(owner_id)
        if slot is None or slot[0]() is not owner:
            try:
                ref = weakref.ref(owner, self._forget(owner_id))
            except TypeError:  # not weakly referenceable: never memoized
                return
            slot = (ref, BoundedMemo(self.per_owner, self.name, register=False))
            self._owners[owner_id] = slot
        slot[1][key] = value

    def _forget(self, owner_id: int):
        owners = weakref.ref(self._owners)

        def callback(ref) -> None:
            table = owners()
            if table is None:
                return
            slot = table.get(owner_id)
            if slot is not None and slot[0] is ref:
                table.pop(owner_id)
        return callback

    def _own_memos(self) -> list:
        return [getattr(owner, _ON_OWNER)[self] for owner in list(self._self_owners)]

    def __len__(self) -> int:
        """Entries over all owners."""
        return (sum(len(slot[1]) for slot in self._owners.values())
                + sum(len(memo) for memo in self._own_memos()))

    def values(self) -> list:
        return ([v for slot in self._owners.values() for v in slot[1].values()]
                + [v for memo in self._own_memos() for v in memo.values()])

    def owner_count(self) -> int:
        return len(self._owners) + len(self._self_owners)

    def clear(self) -> None:
        self._owners.clear()
        for memo in self._own_memos():
            memo.clear()


def clear_all() -> None:
    """Empty every BoundedMemo and OwnedMemo of this process."""
    for memo in list(_ALL):
        memo.clear()


class MaskedMemo:
    """Entries that may depend on a block mask: those of a mask live under it in an
    ``OwnedMemo`` (dropped with the mask, and its tables with them), the others (mask None)
    in a ``BoundedMemo``."""

    def __init__(self, size: int, per_mask: int, name: str = ""):
        self.dense = BoundedMemo(size, name)
        self.masked = OwnedMemo(owners=size, per_owner=per_mask, name=name)

    def get(self, block_mask, key, default=None):
        if block_mask is None:
            return self.dense.get(key, default)
        return self.masked.get(block_mask, key, default)

    def put(self, block_mask, key, value) -> None:
        if block_mask is None:
            self.dense[key] = value
        else:
            self.masked.put(block_mask, key, value)

    def __len__(self) -> int:
        return len(self.dense) + len(self.masked)

    def values(self) -> list:
        return self.dense.values() + self.masked.values()

    def clear(self) -> None:
        self.dense.clear()
        self.masked.clear()


_VERSION = operator.attrgetter("_version")


def contents_keys(tensors) -> list | None:
    """What tells whether each of ``tensors``' (a sequence) values may have changed since: its
    version counter, bumped by each in-place edit, and its memory's address (``data_ptr``),
    which ``t.data = other`` changes while keeping the counter. An address names memory only
    while it is allocated: keep ``memory_of`` each tensor beside the keys. Not told apart:
    another view of the same memory at the same address (``t.data = t.data[:2]``), and writes
    neither shows (through a NumPy or DLPack view, a kernel of one's own). None if one is an
    inference tensor (no version counter) or has no plain memory (sparse, a subclass's
    wrapper): whoever keeps it treats None as never unchanged. (C functions over the
    sequence, no Python function entered per tensor: a cached call checks up to 8
    block-mask tables this way, 2.8 us on the development CPU against 0.8 us for the version
    counters alone.)"""
    try:
        return list(zip(map(_VERSION, tensors), map(torch.Tensor.data_ptr, tensors)))
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def contents_key(tensor) -> tuple | None:
    """``contents_keys`` of one tensor."""
    keys = contents_keys((tensor,))
    return None if keys is None else keys[0]


def memory_of(tensor):
    """``tensor``'s storage, held beside a ``contents_keys`` key: while held, its address is
    no other memory's (a freed block's address is given to the next allocation). A tensor
    given other memory (``t.data = other``) keeps its old memory alive until the key is
    replaced (the next call that compares it). None without a plain storage."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def contents_of(tensors) -> tuple | None:
    """(the ``contents_keys`` of ``tensors`` as a tuple, ``memory_of`` each), or None where
    one has no key: a memo compares the keys and keeps the memory beside them."""
    keys = contents_keys(tensors)
    if keys is None:
        return None
    return tuple(keys), tuple(map(memory_of, tensors))


def version_of(tensor) -> int | None:
    """``tensor``'s version counter (bumped by each in-place edit), the key of what a cache
    derived from its values; None for an inference tensor, which has none (its edits cannot
    be told: whoever keeps this must treat None as never unchanged)."""
    return None if tensor.is_inference() else tensor._version
