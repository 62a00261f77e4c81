"""Load balancing of one ring call: which of the sequence's query tiles each rank works on.

Zigzag gives every rank the same causal work for one document. Under a mask program
that is not (packed documents of uneven length, padding, a window), the ranks' work
can differ by 1.2-1.9x (``benchmarks/packed_balance.py``). torch's per-document
head-tail balancer permutes the whole sequence so that each document is cut into 2P
pieces; every position-dependent op of the graph must then follow that permutation.
Here the ring op balances its own work instead, inside the call, so nothing outside
it changes:

- ``tile_costs``: the kernel area of every (query tile, key tile) pair, bounded from
  the program on a grid of blocks (a surely hidden block costs nothing);
- ``balanced_tiling``: query tiles of one sub-ring swapped between the busiest and the
  least busy rank while that helps (each rank keeps its number of tiles per sub-ring,
  so every buffer keeps its shape; few swaps, few rows moved), or, if clearly better,
  all dealt anew longest processing time first; kept only if the modelled ring time
  (``ring_time``) drops by ``MIN_GAIN``;
- only queries move: K/V tiles travel round the ring from their home rank (their
  gradients arrive there), as far as the farthest rank whose queries see them; a query
  tile that stays keeps its local rows, so that only the moved tiles' q rows travel,
  and their outputs and dq back (``attention/transport.py``).

The time model counts kernel work, not bytes: the K/V that a plan sends further (keys
whose queries moved) are taken to hide behind the kernels, as they do for tiles of
1024 rows and more on GPUs. So a plan can send more than zigzag does
(``benchmarks/RESULTS.md``, section 7, says how much).

Every rank computes the same plan from the same replicated program inputs.
"""

from __future__ import annotations

import torch

from ringify.runtime.masks.bounds import settled_pairs
from ringify.runtime.masks.program import MaskProgram
from ringify.runtime.masks.tile_masks import TileMasks
from ringify.runtime.tiling import tiles as tiling_sizes
from ringify.runtime.tiling.tiles import MIN_TILE_ROWS, Tile, Tiling, all_tiles

# A balanced plan moves rows between ranks (bytes, and their buffers): keep it only when
# it shortens the modelled ring time by at least this fraction.
MIN_GAIN = 0.05
# Blocks the cost grid is cut into at most (its bounds are blocks x blocks).
MAX_COST_BLOCKS = 512
# Swaps tried per plan at most, per rank of the ring (each costs O(tiles^2) to choose).
MAX_SWAPS_PER_RANK = 8
# On an accelerator a balanced plan's moves cost the host of every call ~25 launches forward
# and as many backward (its query rows out, the results home: ~0.5 ms per layer measured,
# in the history of benchmarks/RESULTS.md); an H100 runs that long a 2048 x 2048 block at
# Llama-8B's heads, forward and backward. So there a plan must also save at least that much kernel area.
DEVICE_MOVE_AREA = 2048 * 2048


def min_gain_area(device_type: str) -> float:
    """The kernel area (query rows x keys) a balanced plan must save on ``device_type``."""
    return DEVICE_MOVE_AREA if tiling_sizes.on_accelerator(device_type) else 0.0


def tile_owners(tiling: Tiling, tiles: list[Tile], ring_size: int) -> torch.Tensor:
    """(n,) the rank that works on each of ``tiles`` (global order) under ``tiling``."""
    index = {t.key: i for i, t in enumerate(tiles)}
    owners = torch.zeros(len(tiles), dtype=torch.long)
    for r in range(ring_size):
        for t in tiling(r):
            owners[index[t.key]] = r
    return owners


def tile_costs(tiles: list[Tile], program: MaskProgram, inputs, key_len: int) -> torch.Tensor:
    """(n, n) float64: the kernel area the ring op spends on each (query, key) tile pair
    of ``tiles`` (global order), from the program's bounds on a grid of blocks."""
    total = max(t.start + t.length for t in tiles)
    block = max(MIN_TILE_ROWS, -(-total // MAX_COST_BLOCKS))
    blocks, owner = [], []
    for i, t in enumerate(tiles):
        for a in range(0, t.length, block):
            rows = min(block, t.length - a)
            blocks.append(Tile(slice(a, a + rows), (i, a), t.start + a))
            owner.append(i)
    hidden, _ = settled_pairs(program, [x.detach() for x in inputs], blocks, blocks, key_len)
    q_rows = torch.tensor([b.length for b in blocks], dtype=torch.float64)
    keys = torch.tensor(
        [max(0, min(b.length, key_len - b.start)) for b in blocks], dtype=torch.float64
    )
    area = q_rows.view(-1, 1) * keys.view(1, -1) * (~hidden)
    one_hot = torch.nn.functional.one_hot(torch.tensor(owner), len(tiles)).double()
    return one_hot.T @ area @ one_hot


def ring_time(costs: torch.Tensor, queries, keys, sub_rings: torch.Tensor, ring_size) -> float:
    """The modelled time of a plan (``queries``, ``keys``: the rank that owns each tile's
    queries and keys): at each step of each sub-ring every rank attends from all its
    query tiles to the key tiles it holds (those of rank - step); it starts the next
    step once it is done and both neighbours have started this one (its tiles were sent
    and its sends received), so a rank runs at most a step ahead of its neighbours."""
    per_rank = torch.zeros(ring_size, costs.shape[0], dtype=costs.dtype)
    per_rank.index_add_(0, queries, costs)  # rank r's queries x each key tile
    n_sub = int(sub_rings.max()) + 1
    held = torch.zeros(n_sub, ring_size, ring_size, dtype=costs.dtype)  # [sub, r, src]
    held.index_put_(
        (sub_rings.repeat(ring_size), torch.arange(ring_size).repeat_interleave(len(keys)),
         keys.repeat(ring_size)),
        per_rank.flatten(), accumulate=True,
    )  # fmt: skip
    ranks = torch.arange(ring_size)
    src = (ranks.view(-1, 1) - ranks.view(1, -1)) % ring_size  # [r, step]
    work = held.gather(2, src.expand(n_sub, -1, -1)).permute(0, 2, 1).reshape(-1, ring_size)
    clock = [0.0] * ring_size
    for step in work.tolist():  # [r] of each (sub-ring, step) in order
        start = clock
        clock = [
            max(start[r] + w, start[r - 1], start[(r + 1) % ring_size]) for r, w in enumerate(step)
        ]
    return max(clock)


def balanced_tiling(masks: TileMasks, min_area: float = 0.0) -> Tiling | None:
    """The query tiles of each rank, if working on them makes the ring time at least
    ``MIN_GAIN`` and ``min_area`` (``min_gain_area``) shorter than on its own tiles
    (``masks.home``) under ``masks``' program, with the same local rows on every rank
    (tiles change rank, never shape); None when the home tiling is as good. Key tiles
    stay home."""
    ring_size = masks.ring_size
    tiles = all_tiles(masks.home, ring_size)
    home = tile_owners(masks.home, tiles, ring_size)
    costs = tile_costs(tiles, masks.program, masks.inputs, masks.key_len)
    sub_rings = torch.tensor([t.sub_ring for t in tiles])
    work = costs.sum(1)

    def modelled(owners):
        return ring_time(costs, owners, home, sub_rings, ring_size)

    before = modelled(home)
    owners = _fewest_swaps(work, home, sub_rings, ring_size)
    after = modelled(owners)
    dealt = _longest_first(work, home, sub_rings, ring_size)
    anew = modelled(dealt)
    if anew < (1 - MIN_GAIN) * after:  # dealing anew moves most rows: it must clearly win
        owners, after = dealt, anew
    if after > (1 - MIN_GAIN) * before or before - after < min_area:
        return None
    plan = {r: [] for r in range(ring_size)}
    for i in owners.argsort(stable=True).tolist():  # by rank, then global order
        plan[int(owners[i])].append(tiles[i])
    homes = {t.key: (r, t.rows.start) for r in range(ring_size) for t in masks.home(r)}
    placed = {r: _in_home_slots(masks.home(r), plan[r], homes) for r in range(ring_size)}
    return placed.__getitem__


def _fewest_swaps(work, home, sub_rings, ring_size) -> torch.Tensor:
    """Owners balanced by few moves: while it lowers the busiest rank's work, swap one of
    its tiles with a lighter tile of the same sub-ring on the least busy rank (every
    rank keeps its tiles per sub-ring; a swap moves two tiles, both ways)."""
    owners = home.clone()
    same_sub = sub_rings.view(-1, 1) == sub_rings.view(1, -1)
    for _ in range(MAX_SWAPS_PER_RANK * ring_size):
        load = torch.zeros(ring_size, dtype=work.dtype).index_add_(0, owners, work)
        hi, lo = int(load.argmax()), int(load.argmin())
        gain = work.view(-1, 1) - work.view(1, -1)  # [a, b]: hi gives a, takes b
        ok = (owners == hi).view(-1, 1) & (owners == lo).view(1, -1) & same_sub & (gain > 0)
        # the pair's larger load after the swap, lowest first
        after = torch.maximum(load[hi] - gain, load[lo] + gain).masked_fill(~ok, float("inf"))
        best = int(after.argmin())
        if not after.flatten()[best] < load[hi]:
            break
        a, b = divmod(best, len(work))
        owners[a], owners[b] = lo, hi
    return owners


def _longest_first(work, home, sub_rings, ring_size) -> torch.Tensor:
    """Owners dealt anew by longest processing time first: each tile, heaviest first,
    goes to the least busy rank with a free slot in the tile's sub-ring."""
    free = {}
    for t, r in zip(sub_rings.tolist(), home.tolist(), strict=True):
        free[t, r] = free.get((t, r), 0) + 1
    load = [0.0] * ring_size
    owners = home.clone()
    for i in sorted(range(len(work)), key=lambda i: (-float(work[i]), i)):
        t = int(sub_rings[i])
        r = min((r for r in range(ring_size) if free[t, r]), key=lambda r: (load[r], r))
        free[t, r] -= 1
        load[r] += float(work[i])
        owners[i] = r
    return owners


def _in_home_slots(home: list[Tile], mine: list[Tile], homes: dict[tuple, tuple]) -> list[Tile]:
    """``mine`` placed in the local rows of ``home``: a tile that stays keeps its own
    rows (nothing to copy, ``attention/transport.py``); the others take the slots that the tiles
    leaving free, in local order, a slot of its own length to each, in the order their
    home ranks send them (``homes``: a tile's (home rank, local rows start) by key), so that
    tiles side by side on their home arrive side by side and travel as one message."""
    staying = {t.key for t in mine} & {t.key for t in home}
    arriving = sorted((t for t in mine if t.key not in staying), key=lambda t: homes[t.key])
    placed = []
    for slot in home:
        t = slot
        if slot.key not in staying:
            t = next(a for a in arriving if a.length == slot.length)
            arriving.remove(t)
        placed.append(Tile(slot.rows, t.key, t.start))
    return placed
