"""Tail-biting Viterbi over EXL3's bitshift trellis, many tiles at once.

A tile is a sequence of T = 256 target values (tensor-core order). Its encoding is
a walk over L = 16-bit states ``s_t = ((s_{t-1} << K) | c_t) & (2^L - 1)``; weight t
decodes to ``table[s_t]``. The walk is a ring (tail-biting): the state before
t = 0 is the last one, so ``s_0 >> K`` must equal the low L - K bits of ``s_{T-1}``.

Graph (spec §1.5 step 8): a node is the low L - K bits of a state (the part the
future sees); a state is a node plus its top K bits, which name the predecessor
node ``state >> K``. With the state's bits split as ``(k, hi, lo)`` (K, L - 2K, K
bits), the node is ``(hi, lo)`` and the predecessor ``(k, hi)``, so one step over all
states is a broadcast, no gather:

    cand[b, k, hi, lo] = cost[b, (k, hi)] + (table[k, hi, lo] - w[b, t])^2
    cost'[b, (hi, lo)] = min over k of cand

That is 2^L edge evaluations per step whatever K is. Two passes make the ring
(QTIP's Algorithm 4): an unconstrained pass over a window of the tile rotated so
the wrap point sits in its middle, whose best path gives the node at the wrap;
then a full pass whose start is forced to that node and whose end is read at the
same node, so the walk closes.

Two ways to remember the decisions, same result:

* ``indices`` (CUDA): keep the argmin k of every node at every step; the
  backtrack is one gather per step.
* ``recompute`` (CPU, where an argmin reduction is ~20x slower than a plain min):
  keep every step's cost vector; the backtrack recomputes the 2^K candidates of
  the one node on the path.

Costs are relative to the per-tile minimum, re-zeroed every ``normalize_every``
steps, so float16 costs keep their precision on long walks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("trellm")

TILE_STEPS = 256
STATE_BITS = 16


@dataclass(frozen=True)
class Trellis:
    """The bitshift trellis: K new bits per step over L-bit states."""

    bits: int
    """K."""
    state_bits: int = STATE_BITS
    """L (16 in EXL3; smaller only in tests, where walks can be enumerated)."""

    def __post_init__(self):
        if not (1 <= self.bits and 2 * self.bits <= self.state_bits):
            raise ValueError(f"trellis needs 1 <= K <= L/2, got K={self.bits}, L={self.state_bits}")

    @property
    def nodes(self) -> int:
        return 1 << (self.state_bits - self.bits)

    @property
    def fan(self) -> int:
        """2^K: predecessors per node, successors per node."""
        return 1 << self.bits

    @property
    def mid(self) -> int:
        """2^(L - 2K): the size of the ``hi`` field."""
        return 1 << (self.state_bits - 2 * self.bits)


@dataclass(frozen=True)
class ViterbiOptions:
    wrap_window: int = 64
    """Steps of the first (wrap-finding) pass, centred on the wrap point. The node at
    the wrap depends on nearby weights only (a state spans 16/K steps); 256 is the
    whole rotated tile, as in QTIP."""
    normalize_every: int = 4
    """Re-zero costs at the per-tile minimum this often (steps)."""
    track: str = "auto"
    """'indices', 'recompute' or 'auto' (indices on CUDA, recompute elsewhere)."""
    cost_dtype: torch.dtype | None = None
    """None: float32. float16 halves the memory traffic of the eager steps."""
    memory_bytes: int | None = None
    """Budget for one chunk's buffers; None: 256 MiB on the CPU, a tenth of the GPU (at
    most 8 GiB) on CUDA."""
    max_chunk: int | None = None
    """Most tiles per chunk (the CPU is fastest with chunks that stay in cache)."""
    compile: bool = False
    """Run each step as one fused kernel through ``torch.compile`` (indices mode);
    any failure falls back to the eager step with a warning."""


def tail_biting(targets: torch.Tensor, table: torch.Tensor, trellis: Trellis,
                options: ViterbiOptions = ViterbiOptions(),
                on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
    """Best closed walk for each row of ``targets`` [B, T] (float) under ``table``
    [2^L] (state -> value). Returns int64 states [B, T]; ``on_chunk(n)`` is called
    after every chunk of n tiles."""
    if table.numel() != 1 << trellis.state_bits:
        raise ValueError(f"table has {table.numel()} entries, trellis has {1 << trellis.state_bits} states")
    b, steps = targets.shape
    out = torch.empty(b, steps, dtype=torch.int64, device=targets.device)
    if b == 0:
        return out
    runner = _Runner(table, trellis, options, targets.device, steps)
    for i in range(0, b, runner.chunk):
        part = targets[i:i + runner.chunk]
        out[i:i + part.shape[0]] = runner.run(part)
        if on_chunk is not None:
            on_chunk(part.shape[0])
    return out


def open_walk(targets: torch.Tensor, table: torch.Tensor, trellis: Trellis,
              options: ViterbiOptions = ViterbiOptions(), start: torch.Tensor | None = None) -> torch.Tensor:
    """One pass: the best walk, free at both ends, or (``start``: [B] nodes) starting
    at a given node and ending there (a closed walk through that node). int64 states."""
    runner = _Runner(table, trellis, options, targets.device, targets.shape[1])
    return runner.walk(targets.to(runner.dtype), start, start)


def walk_cost(states: torch.Tensor, targets: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Squared error of decoding ``states`` against ``targets``, per row (float64)."""
    return (table.double()[states] - targets.double()).square().sum(-1)


class _Runner:
    """Buffers and the step function for one (device, trellis, options)."""

    def __init__(self, table: torch.Tensor, trellis: Trellis, options: ViterbiOptions,
                 device: torch.device, steps: int):
        self.t = trellis
        self.o = options
        self.device = device
        self.steps = steps
        cuda = device.type == "cuda"
        self.dtype = options.cost_dtype or (torch.float16 if cuda else torch.float32)
        track = options.track if options.track != "auto" else ("indices" if cuda else "recompute")
        if track not in ("indices", "recompute"):
            raise ValueError(f"unknown Viterbi tracking {options.track!r}")
        self.track = track
        self.table = table.to(device=device, dtype=torch.float32)
        fan, mid = trellis.fan, trellis.mid
        self.table4 = self.table.to(self.dtype).view(1, fan, mid, fan)  # [1, k, hi, lo]
        # Recompute mode at small K: [k, lo, hi] (see _transposed_step).
        self.transposed = track == "recompute" and fan <= 16
        self.table4t = self.table4.transpose(2, 3).contiguous() if self.transposed else None
        # pred_base[hi, lo] = hi: a node's predecessor is k * mid + hi.
        self.pred_base = torch.arange(mid, device=device).view(mid, 1).expand(mid, fan)
        self.window = min(max(2, options.wrap_window // 2 * 2), steps // 2 * 2) if steps > 1 else steps
        self.chunk = self._chunk_size()
        self.fused = _checked_fused_step(trellis, self.table4) if options.compile and track == "indices" else None

    def _chunk_size(self) -> int:
        budget = self.o.memory_bytes
        if budget is None and self.device.type == "cuda":
            # A tenth of the card, at most 8 GiB: several quantizations may share one GPU.
            budget = min(8 << 30, torch.cuda.get_device_properties(self.device).total_memory // 10)
        elif budget is None:
            budget = 256 << 20
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_step = self.t.nodes * (2 if self.track == "indices" else elem)
        per_tile = (self.steps + 1) * per_step + (3 * elem + 8) * (1 << self.t.state_bits)
        chunk = max(1, budget // per_tile)
        if self.o.max_chunk is None and self.device.type != "cuda":
            chunk = min(chunk, 8)  # the CPU is fastest when a step's buffers stay in cache
        return int(min(chunk, self.o.max_chunk or chunk))

    def run(self, w: torch.Tensor) -> torch.Tensor:
        """Tail-biting walks of one chunk: find the wrap node, then the closed walk."""
        w = w.to(self.dtype)
        half = self.window // 2
        if self.window < w.shape[1]:
            # The last `half` steps, then the first `half`: the wrap sits between them.
            rotated = torch.cat([w[:, w.shape[1] - half:], w[:, :half]], dim=1)
        else:
            rotated = torch.roll(w, half, dims=1)
        first = self.walk(rotated, None, None)
        wrap = first[:, half - 1] & (self.t.nodes - 1)
        return self.walk(w, wrap, wrap)

    def walk(self, w: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor | None) -> torch.Tensor:
        """States of the best walk (free start/end where None)."""
        hist, trace, last = self._forward(w, start)
        if end is None:
            end = last.argmin(dim=1)
        if self.track == "indices":
            path = self._backtrack_indices(trace, end)
        else:
            path = self._backtrack_recompute(hist, w, end)
        # state_t = (node_{t-1} << K) | low K bits of node_t
        return ((path[:-1] << self.t.bits) | (path[1:] & (self.t.fan - 1))).t().contiguous()

    # ---- forward ----------------------------------------------------------------------------

    def _forward(self, w: torch.Tensor, start: torch.Tensor | None):
        """Costs after every step (recompute: all; indices: the last two), and in indices
        mode each node's best predecessor at every step (int16: nodes < 2^15)."""
        b, steps = w.shape
        t = self.t
        keep = steps + 1 if self.track == "recompute" else 2
        hist = torch.empty(keep, b, t.nodes, dtype=self.dtype, device=self.device)
        trace = (torch.empty(steps, b, t.nodes, dtype=torch.int16, device=self.device)
                 if self.track == "indices" else None)
        cost = hist[0]
        if start is None:
            cost.zero_()
        else:
            cost.fill_(float("inf"))
            cost.scatter_(1, start[:, None], 0.0)
        step_fn = self._step_fn(b)
        for step in range(steps):
            if step and step % self.o.normalize_every == 0:
                cost.sub_(cost.amin(dim=1, keepdim=True))
            nxt = hist[(step + 1) % keep]
            step_fn(cost, w[:, step].view(b, 1, 1, 1), nxt, None if trace is None else trace[step])
            cost = nxt
        return hist, trace, cost

    def _step_fn(self, b: int) -> Callable:
        """The step for a chunk of b tiles: (cost, w_t, next cost, predecessor out or None)."""
        t = self.t
        if self.transposed:
            return self._transposed_step(b)
        if self.fused is None:
            return self._natural_step(b)
        eager: list[Callable] = []  # built on a first failure only: its buffers are large

        def fused(cost, wt, nxt, trace_row):
            if self.fused is not None:
                try:
                    vals, pred = self.fused(cost, self.table4, wt, self.pred_base)
                    nxt.copy_(vals)
                    trace_row.copy_(pred)
                    return
                except Exception as e:  # e.g. a recompile for a new shape failing: eager is always right
                    log.warning("compiled Viterbi step failed (%s); using the eager step", str(e).splitlines()[0])
                    _COMPILED[(self.t, str(self.device), self.dtype)] = self.fused = None
            if not eager:
                eager.append(self._natural_step(b))
            eager[0](cost, wt, nxt, trace_row)
        return fused

    def _natural_step(self, b: int) -> Callable:
        """Candidates in state order [b, k, hi, lo]."""
        t = self.t
        diff = torch.empty(b, t.fan, t.mid, t.fan, dtype=self.dtype, device=self.device)
        cand = torch.empty_like(diff)
        picks = torch.empty(b, t.mid, t.fan, dtype=torch.int64, device=self.device)

        def natural(cost, wt, nxt, trace_row):
            torch.sub(self.table4, wt, out=diff)
            torch.addcmul(cost.view(b, t.fan, t.mid, 1), diff, diff, out=cand)
            if trace_row is None:
                torch.amin(cand, dim=1, out=nxt.view(b, t.mid, t.fan))
            else:
                torch.min(cand, dim=1, out=(nxt.view(b, t.mid, t.fan), picks))
                torch.add(self.pred_base, picks, alpha=t.mid, out=trace_row.view(b, t.mid, t.fan))
        return natural

    def _transposed_step(self, b: int) -> Callable:
        """Candidates laid out [b, k, lo, hi]: the cost broadcast runs along lo, outside
        the long contiguous hi (the natural layout broadcasts along a short inner lo,
        which the CPU runs several times slower); one gather puts the minima, which
        come out lo-major, back in node order."""
        t = self.t
        diff = torch.empty(b, t.fan, t.fan, t.mid, dtype=self.dtype, device=self.device)
        cand = torch.empty_like(diff)
        low_major = torch.empty(b, t.fan * t.mid, dtype=self.dtype, device=self.device)
        # Node (hi, lo) is at lo * mid + hi among the minima, at hi * fan + lo in the costs.
        order = torch.arange(t.fan * t.mid, device=self.device).view(t.fan, t.mid).t().reshape(-1)

        def transposed(cost, wt, nxt, trace_row):
            torch.sub(self.table4t, wt, out=diff)
            torch.addcmul(cost.view(b, t.fan, 1, t.mid), diff, diff, out=cand)
            torch.amin(cand, dim=1, out=low_major.view(b, t.fan, t.mid))
            torch.index_select(low_major, 1, order, out=nxt)
        return transposed

    # ---- backtracking -------------------------------------------------------------------------

    def _backtrack_indices(self, trace: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Node path [steps + 1, b] (the node before step 0 first): one gather per step."""
        steps, b, _ = trace.shape
        path = torch.empty(steps + 1, b, dtype=torch.int64, device=self.device)
        path[steps] = end
        for step in range(steps - 1, -1, -1):
            path[step] = trace[step].gather(1, path[step + 1].view(b, 1)).view(b)
        return path

    def _backtrack_recompute(self, hist: torch.Tensor, w: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Node path [steps + 1, b]: each step re-evaluates the 2^K ways into the node on
        the path with the forward's own arithmetic, and takes the cheapest."""
        t = self.t
        b, steps = w.shape
        path = torch.empty(steps + 1, b, dtype=torch.int64, device=self.device)
        path[steps] = end
        ks = torch.arange(t.fan, device=self.device)
        pred_hi, state_hi = ks * t.mid, ks << (t.state_bits - t.bits)
        table = self.table.to(self.dtype)
        node = end.to(torch.int64)[:, None]
        for step in range(steps - 1, -1, -1):
            preds = pred_hi + (node >> t.bits)                      # [b, 2^K]
            diff = table[state_hi + node] - w[:, step:step + 1]
            vals = torch.addcmul(hist[step].gather(1, preds), diff, diff)
            node = preds.gather(1, vals.argmin(dim=1, keepdim=True))
            path[step] = node.view(b)
        return path


def _step(cost: torch.Tensor, table4: torch.Tensor, wt: torch.Tensor, pred_base: torch.Tensor):
    """One step as a pure function (what ``torch.compile`` fuses into one kernel):
    the next costs and each node's best predecessor."""
    b, fan, mid = cost.shape[0], table4.shape[1], table4.shape[2]
    diff = table4 - wt
    cand = cost.view(b, fan, mid, 1) + diff * diff
    vals, picks = cand.min(dim=1)
    return vals.reshape(b, -1), (picks * mid + pred_base).reshape(b, -1).to(torch.int16)


_COMPILED: dict[tuple, Callable | None] = {}


def _checked_fused_step(trellis: Trellis, table4: torch.Tensor) -> Callable | None:
    """``_step`` compiled, once per (K, device, dtype), after checking it against the
    eager step on random costs; None (with a warning) if compiling fails or disagrees."""
    key = (trellis, str(table4.device), table4.dtype)
    if key not in _COMPILED:
        try:
            fn = torch.compile(_step, dynamic=True)
            g = torch.Generator(device=table4.device).manual_seed(0)
            cost = torch.rand(3, trellis.nodes, generator=g, device=table4.device).to(table4.dtype)
            wt = torch.randn(3, 1, 1, 1, generator=g, device=table4.device).to(table4.dtype)
            base = torch.arange(trellis.mid, device=table4.device).view(-1, 1).expand(trellis.mid, trellis.fan)
            got, want = fn(cost, table4, wt, base), _step(cost, table4, wt, base)
            torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-2)
            # The fused kernel may round differently, so near-ties can pick another predecessor.
            if float((got[1] == want[1]).float().mean()) < 0.99:
                raise ValueError("compiled step picks different predecessors")
            _COMPILED[key] = fn
        except Exception as e:  # compile errors come in many types; the eager step is always there
            log.warning("compiled Viterbi step unavailable (%s); using the eager step", str(e).splitlines()[0])
            _COMPILED[key] = None
    return _COMPILED[key]
