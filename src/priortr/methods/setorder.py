"""The order in which CPython iterates a ``set`` of small non-negative ints, computed on the device.

DART's authors visit their pivot tokens in the order of a Python set of their prompt positions
(``for item in list(indices_set)``), and the order decides which pivot takes a token that two pivots
both rank least similar. A set iterates its hash table slot by slot, and for ints ``hash(v) == v``,
so the order follows from CPython's ``Objects/setobject.c`` (``set_add_entry``, ``set_insert_clean``,
``set_table_resize``): emulated here with tensor operations, so the selector reads nothing back to the
host. Checked against ``set`` itself in tests/methods/test_methods_dart.py.
"""

from __future__ import annotations

import torch

_MIN_TABLE = 8
"""CPython's ``PySet_MINSIZE``: a new set's hash table has 8 slots."""
_LINEAR_PROBES = 9
"""CPython's ``LINEAR_PROBES``: slots tried after the home slot before perturbing (``setobject.c``)."""
_PERTURB_SHIFT = 5


def _probe_sequence(values: torch.Tensor, size: int) -> torch.Tensor:
    """[P, C] the slots a CPython set of ``size`` slots tries, in order, to insert each of the small
    non-negative ints ``values`` [P] (``hash(v) == v``), -1 where a step tries no slot.

    ``set_add_entry`` / ``set_insert_clean``: home slot ``v & mask``, then the next ``LINEAR_PROBES``
    slots if they fit before the table's end, then ``i = (5 i + 1 + perturb) & mask`` with ``perturb``
    shifted right by 5 each round. Once ``perturb`` is 0 the recurrence visits every slot within
    ``size`` rounds, so ``size + 8`` rounds always reach a free one.
    """
    mask = size - 1
    steps = torch.arange(_LINEAR_PROBES + 1, device=values.device)  # [L]
    home, perturb = values & mask, values.clone()
    rounds = []
    for _ in range(size + 8):
        linear = home[:, None] + steps  # [P, L]
        fits = (home + _LINEAR_PROBES <= mask)[:, None] | (steps == 0)
        rounds.append(torch.where(fits, linear, -1))
        perturb = perturb >> _PERTURB_SHIFT
        home = (home * 5 + 1 + perturb) & mask
    return torch.cat(rounds, dim=1)


def _insert(table: torch.Tensor, slots: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
    """``table`` [T] (item index per slot, -1 empty) with ``item`` (0-d) in the first free slot of its
    probe sequence ``slots`` [C]."""
    free = (slots >= 0) & (table[slots.clamp(min=0)] < 0)  # [C]
    slot = slots.index_select(0, free.int().argmax().view(1))  # [1]: a 0-d index would read the host
    return table.scatter(0, slot, item.view(1))


def _slot_order(table: torch.Tensor, count: int) -> torch.Tensor:
    """[count] the items of ``table`` [T] in slot order (the order a set iterates them)."""
    slots = torch.arange(table.numel(), device=table.device)
    occupied_first = torch.where(table >= 0, slots, slots + table.numel())
    return table[occupied_first.argsort()[:count]]


def set_order(values: torch.Tensor) -> torch.Tensor:
    """[P] the order in which CPython iterates ``set(values.tolist())`` for distinct small non-negative
    ints ``values`` [P], as indices into ``values``, computed on the device (no host sync).

    ``set(list)`` adds the items one by one to an 8-slot table and, when ``fill * 5 >= mask * 3``,
    moves them in slot order to a table of the next power of two above ``4 * used`` slots.
    """
    count = values.numel()
    items = torch.arange(count, device=values.device)
    size = _MIN_TABLE
    probes = _probe_sequence(values, size)  # [P, C] each value's slots in this table
    table = torch.full((size,), -1, dtype=torch.long, device=values.device)
    for used in range(1, count + 1):
        table = _insert(table, probes[used - 1], items[used - 1])
        if used * 5 >= (size - 1) * 3:
            moved = _slot_order(table, used)
            size = _MIN_TABLE
            while size <= used * 4:
                size *= 2
            probes = _probe_sequence(values, size)
            table = torch.full((size,), -1, dtype=torch.long, device=values.device)
            moved_probes = probes.index_select(0, moved)  # [used, C]
            for index in range(used):
                table = _insert(table, moved_probes[index], moved[index])
    return _slot_order(table, count)
