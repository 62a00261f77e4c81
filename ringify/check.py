"""``ringify.check``: the ringified model against the unmodified one, on a few CPU ranks.

A user runs it before spending a cluster: on small inputs, the model ringified over P gloo
ranks must give the unmodified model's outputs and gradients, forward and backward, in
training mode. The ranks are forked processes of the caller, each with a real gloo process
group: a fork hands each rank the model and inputs as they are (no pickling, so a model
defined in a notebook or holding closures works), and a real group runs every collective
the ring uses (P2P send and receive, all-to-all), which torch's threaded test group does
not. Every dropout's probability is 0 for the comparison, through a ``TorchFunctionMode``
on the ranks (ringify's dropout masks are the model's in distribution, not bit for bit);
the model is cast to ``dtype`` (float64 by default, where the two agree to rounding). In
another dtype the bound of each row is measured: the unmodified model's own error against
itself in float64, doubled. The ranks run in strict mode: a rule of ringify's that raises
fails the check instead of being gathered.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ringify.module import ringify
from ringify.passes.graph.report import STRICT, Report
from ringify.runtime.collectives.agreement import RankFailed
from ringify.testing.tolerance import UNDER_INDUCTOR

log = logging.getLogger("ringify")

FLOAT64_BOUND = 1e-9  # relative to the row's largest reference value (at least 1)


@dataclass(frozen=True)
class Difference:
    """One output's or one parameter gradient's largest difference from the unmodified model."""

    name: str
    kind: str  # "output" or "gradient"
    max_diff: float
    scale: float  # the largest absolute value of the unmodified model's
    bound: float

    @property
    def passed(self) -> bool:
        return self.max_diff <= self.bound


@dataclass(frozen=True)
class Checked:
    """What ``check`` found: every row, worst first, and rank 0's report."""

    ring_size: int
    dtype: torch.dtype
    rows: tuple[Difference, ...]
    report: Report
    compiled: str | None = None
    failed: tuple[Difference, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "failed", tuple(r for r in self.rows if not r.passed))

    @property
    def passed(self) -> bool:
        return not self.failed

    def __str__(self) -> str:
        verdict = "exact" if self.passed else f"{len(self.failed)} row(s) beyond their bound"
        head = (
            f"ringify.check: ring of {self.ring_size}, {self.dtype}, "
            f"{self.compiled or 'eager'}: {verdict}; gathers: {len(self.report.gathers)}, "
            f"attentions run whole: {len(self.report.run_whole)} of {len(self.report.attentions)}"
        )
        rows = [
            (r.name, r.kind, f"{r.max_diff:.3g}", f"{r.scale:.3g}", f"{r.bound:.3g}", r.passed)
            for r in self.rows
        ]
        table = tabulate(rows, headers=("name", "kind", "max diff", "scale", "bound", "ok"))
        return f"{head}\n\n{table}\n\n{self.report}"


def check(
    model: nn.Module,
    *inputs,
    ring_size: int = 2,
    kwargs: dict | None = None,
    compile: str | None = None,
    dtype: torch.dtype = torch.float64,
    timeout: float = 900.0,
    **config,
) -> Checked:
    """Run ``model`` ringified over ``ring_size`` forked gloo ranks on ``inputs`` (and
    ``kwargs``) against the unmodified model, forward and backward, in training mode with
    every dropout's p at 0; the worst difference per output and per gradient.

    - ``compile``: a ``torch.compile`` backend to run the ringified model under
      (``"inductor"``, ``"aot_eager"``), or None for eager;
    - ``dtype``: the model and float inputs are cast to it (on the ranks; the model passed in
      is not changed);
    - ``config``: ``ringify()``'s other options (``strategy``, ``layout``...; not
      ``dilation``, whose attention is not the model's by design).

    Every output's and gradient's difference must stay within its bound (``Checked.passed``);
    ``print(checked)`` shows the table and the report. Call it from a plain process (not one
    that already joined a process group); the loss backpropagated is a fixed random weighting
    of every float output.
    """
    for mode in ("inputs", "outputs", "group", "mesh"):
        if mode in config:
            raise ValueError(
                f"ringify.check compares whole outputs on a ring of its own: leave {mode}= out "
                "(it runs with inputs and outputs full over the default group of its ranks)"
            )
    if config.get("dilation") is not None:
        raise ValueError(
            "ringify.check compares with the unmodified model, and dilation= replaces its "
            "attention by dilated attention (another result by design): check the model "
            "without dilation="
        )
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "ringify.check forks its own ranks and cannot run in a process that already "
            "joined a process group: call it in a plain python process, before "
            "init_process_group (or in a script of its own)"
        )
    if not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"ring_size must be a positive int, got {ring_size!r}")
    if any(t.device.type != "cpu" for t in (*model.parameters(), *model.buffers())):
        model = copy.deepcopy(model).cpu()  # a fork cannot read the GPU's memory
    job = _Job(model, inputs, kwargs or {}, ring_size, compile, dtype, config)
    results = _run_ranks(job, timeout)
    return _checked(job, results)


@dataclass
class _Job:
    model: nn.Module
    inputs: tuple
    kwargs: dict
    ring_size: int
    compile: str | None
    dtype: torch.dtype
    config: dict


def _run_ranks(job: _Job, timeout: float) -> list[dict]:
    """Each forked rank's result, or the first failure raised here with its rank's message."""
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, job, results), daemon=True)
        for r in range(job.ring_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < job.ring_size:
            if not results.empty():
                rank, outcome = results.get()
                got[rank] = pickle.loads(outcome)
                continue
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
            if dead:
                code = procs[dead[0]].exitcode
                raise RuntimeError(f"ringify.check: rank {dead[0]} died (exit code {code})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ringify.check: the ranks did not finish in {timeout} s")
            time.sleep(0.05)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failures = [(r, o) for r, o in sorted(got.items()) if not o[0]]
    if failures:  # the first rank that raised an error of its own, not RankFailed
        rank, (_, (error, detail)) = min(failures, key=lambda f: isinstance(f[1][1][0], RankFailed))
        if error is not None:
            raise error
        raise RuntimeError(f"ringify.check: rank {rank} of {job.ring_size} failed:\n{detail}")
    return [got[r][1] for r in range(job.ring_size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, job: _Job, results) -> None:
    """One forked rank: the unmodified model, then the ringified one, on its own copy."""
    os.environ[STRICT] = "1"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"ringify-check-inductor-{os.getuid()}-{rank}"
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=job.ring_size
        )
        outcome = (True, _compared(job))
    except BaseException as exc:  # every failure goes back to the caller
        detail = "".join(traceback.format_exception(exc))
        outcome = (False, (_picklable(exc), detail))
    # as bytes: torch's reductions would pass the tensors as descriptors of shared memory,
    # gone with this process before the caller reads them
    results.put((rank, pickle.dumps(outcome)))
    if dist.is_initialized():
        dist.destroy_process_group()


def _picklable(exc: BaseException) -> BaseException | None:
    """``exc`` if it crosses a queue as it is (a ValueError naming the fix), else None."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return None


def _compared(job: _Job) -> dict:
    """On a rank: the unmodified model's outputs and gradients (in float64 too where ``dtype``
    is not), then the ringified model's, as flat dicts by name."""
    model = job.model.train()
    state = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    truth = None
    if job.dtype != torch.float64:
        truth = _step(model.to(torch.float64), job, torch.float64)
        model.load_state_dict(state)
    model.to(job.dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = _step(model, job, job.dtype)
    model.load_state_dict(state)
    control = None  # the compiler's own move on the unmodified model (float32 parts fused)
    if job.compile is not None:
        torch._dynamo.reset()
        try:
            compiled = torch.compile(model, backend=job.compile)
            control = _step(compiled, job, job.dtype, params=model)
        except Exception as error:  # the model itself does not compile: bounds stay eager's
            log.warning("ringify.check: the unmodified model did not compile (%s)", error)
        model.load_state_dict(state)
        torch._dynamo.reset()
    ringified = ringify(model, ring_size=job.ring_size, **job.config)
    run = ringified if job.compile is None else torch.compile(ringified, backend=job.compile)
    got = _step(run, job, job.dtype, params=model)
    return {
        "reference": reference,
        "truth": truth,
        "control": control,
        "got": got,
        "report": ringified.report(),
    }


def _step(run, job: _Job, dtype: torch.dtype, params: nn.Module | None = None) -> dict:
    """``run``'s outputs and every parameter's gradient after a backward of a fixed random
    weighting of its float outputs, with every dropout's p at 0; by name."""
    params = params if params is not None else run
    params.zero_grad(set_to_none=True)
    args, kwargs = _cast((job.inputs, job.kwargs), dtype)
    torch.manual_seed(0)
    with _NoDropout():
        out = run(*args, **kwargs)
    leaves = pytree.tree_flatten_with_path(out)[0]
    floats = [(pytree.keystr(k), v) for k, v in leaves if _float_tensor(v)]
    g = torch.Generator().manual_seed(1)
    loss = sum(
        (v * torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype)).sum()
        for _, v in floats
        if v.requires_grad
    )
    if torch.is_tensor(loss):
        loss.backward()
    found = {f"output{k}": v.detach().to(torch.float64) for k, v in floats}
    for name, p in params.named_parameters():
        if p.grad is not None:
            found[name] = p.grad.detach().to(torch.float64)
    return found


def _float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _cast(tree, dtype: torch.dtype):
    return pytree.tree_map(lambda x: x.to(dtype) if _float_tensor(x) else x, tree)


class _NoDropout(TorchFunctionMode):
    """Every dropout the model calls (``nn.Dropout``'s too, and SDPA's ``dropout_p``) at p = 0."""

    DROPOUTS = frozenset({
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
        F.feature_alpha_dropout, torch.dropout,
    })  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            kwargs["dropout_p"] = 0.0
            args = (*args[:4], 0.0, *args[5:]) if len(args) > 4 else args
        elif func in self.DROPOUTS:
            if len(args) > 1:
                args = (args[0], 0.0, *args[2:])
            else:
                kwargs["p"] = 0.0
        return func(*args, **kwargs)


def _checked(job: _Job, results: list[dict]) -> Checked:
    """Rank 0's rows (every rank holds the same outputs and gradients: they are compared to
    the same reference on each)."""
    rows = []
    for r in results:
        for name, want in r["reference"].items():
            got = r["got"].get(name)
            kind = "output" if name.startswith("output") else "gradient"
            if got is None:
                got = torch.zeros_like(want)  # a gradient the ringified graph never reached
            if got.shape != want.shape:
                rows.append(Difference(name, kind, float("inf"), 0.0, 0.0))
                continue
            scale = want.abs().max().item() if want.numel() else 0.0
            truth = None if r["truth"] is None else r["truth"][name]
            if truth is None:
                bound = FLOAT64_BOUND * max(scale, 1.0)
                diff = (got - want).abs().max().item() if want.numel() else 0.0
            else:  # measured: twice the unmodified model's own error in this dtype
                own = (want - truth).abs().max().item() if want.numel() else 0.0
                bound = 2 * own + 8 * torch.finfo(job.dtype).eps * scale
                diff = (got - truth).abs().max().item() if want.numel() else 0.0
            moved = None if r["control"] is None else r["control"].get(name)
            if moved is not None and want.numel():  # compiled: 1.5x the compiler's own move
                bound = max(bound, UNDER_INDUCTOR * (moved - want).abs().max().item())
            rows.append(Difference(name, kind, diff, scale, bound))
    worst: dict[str, Difference] = {}
    for row in rows:  # per name, the worst rank's
        if row.name not in worst or row.max_diff > worst[row.name].max_diff:
            worst[row.name] = row
    ordered = sorted(worst.values(), key=lambda r: -(r.max_diff / r.bound if r.bound else 1e300))
    return Checked(job.ring_size, job.dtype, tuple(ordered), results[0]["report"], job.compile)
