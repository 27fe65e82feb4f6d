"""The fine-tune stage (QAT): train the post-training result with the quantization in the loop, against the
float model's logits computed by the same module tree (no second model in memory), resumable from its own
checkpoints; the trained modules go back as typed layer files. docs/design.md says how."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from quantkit.algorithms.qat import QATFormat, QATLinear, latent_init
from quantkit.data import DataError, pack_windows, read_documents
from quantkit.io import atomic_write_json
from quantkit.algorithms.qat import QATStage
from quantkit.plan import Plan
from quantkit.algorithms.contract import ModuleResult, QuantizedWeight
from quantkit.quantize.workdir import decode_layer, save_typed, split_layer
from quantkit.recipe import CalibrationSpec

log = logging.getLogger("quantkit")
BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 1.0


class QATError(RuntimeError):
    """A QAT problem, phrased for the user."""


@dataclass(frozen=True)
class FinetuneRun:
    """What the fine-tune stage takes from the conversion: the plan (its last stage is this one) and where the
    float model and the training text come from."""

    plan: Plan
    model_dir: Path
    tokenizer: object
    trust_remote_code: bool
    scale_dtype: torch.dtype  # the checkpoint's dtype: scales and the original weights are kept in it
    device: torch.device
    quiet: bool = False
    on_weight: Callable[[str, torch.Tensor], None] | None = None


@dataclass
class QATResult:
    files: list[Path]  # typed layer files of the trained modules (replace the work folder's PTQ layer files)
    summary: dict  # recorded in manifest.json under "qat"
    extra_files: list[Path] = field(default_factory=list)  # copied into the export (the loss curve)


# ----------------------------------------------------------------------------------------------- data
def split_windows(spec: CalibrationSpec, tokenizer, seq_len: int, holdout_fraction: float,
                  seed: int) -> tuple[list[torch.Tensor], list[float], torch.Tensor]:
    """Per-source training windows ([n_i, seq_len] each), their weights, and the held-out windows [m, seq_len]."""
    rng = random.Random(seed)
    train, weights, held = [], [], []
    for i, src in enumerate(spec.sources):
        where = f"calibration.sources[{i}]"
        wins = pack_windows(read_documents(src, where, tokenizer), tokenizer, seq_len, rng)
        rng.shuffle(wins)
        n_hold = max(1, round(len(wins) * holdout_fraction)) if len(wins) >= 2 else 0
        if len(wins) - n_hold < 1:
            raise DataError(f"{where}: {src.path!r} gives {len(wins)} windows of {seq_len} tokens, too few to "
                            "train on; add text or lower the qat stage's seq_len")
        train.append(torch.tensor(wins[n_hold:], dtype=torch.int64))  # [n_i, seq_len]
        held.extend(wins[:n_hold])
        weights.append(src.weight)
    if not held:
        raise DataError("calibration: no held-out window for QAT: add text, or raise the qat stage's "
                        "holdout_fraction / lower its seq_len")
    return train, weights, torch.tensor(held, dtype=torch.int64)


def micro_rows(train: list[torch.Tensor], weights: list[float], seed: int, step: int, micro: int,
               batch_size: int) -> list[tuple[int, int]]:
    """The (source, window) keys of the batch of (step, micro): sources by weight, windows uniformly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro)
    srcs = torch.multinomial(torch.tensor(weights, dtype=torch.float64), batch_size, replacement=True, generator=g)
    return [(s, int(torch.randint(len(train[s]), (1,), generator=g))) for s in srcs.tolist()]


def micro_batch(train: list[torch.Tensor], keys: list[tuple[int, int]]) -> torch.Tensor:
    return torch.stack([train[s][r] for s, r in keys])  # [batch_size, seq_len]


# ---------------------------------------------------------------------------------------------- model
def load_float(model_dir: Path, trust_remote_code: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def build_student(run: FinetuneRun, layer_files: list[Path]) -> tuple[nn.Module, dict, "Teacher"]:
    """The float model with every quantized Linear replaced by a QATLinear that starts at its PTQ result
    (the typed results of the work folder's layer files), and the teacher that computes the float model's
    logits through the same module tree (so only one model is ever in memory: the QATLinears keep their
    original weights in the checkpoint's dtype)."""
    plan, scale_dtype = run.plan, run.scale_dtype
    st: QATStage = plan.finetune.config
    # after a transform (AWQ, SmoothQuant) the float weight is not the transformed one: start at the codes
    nudge = not any(s.role == "transform" for s in plan.stages)
    model = load_float(run.model_dir, run.trust_remote_code)
    params = dict(model.named_parameters())
    modules: dict[str, QATLinear] = {}
    originals: dict[str, torch.Tensor] = {}  # stored values of the float tensors a transform rewrote
    for layer, path in zip(plan.layers, layer_files):
        weights, rewritten = decode_layer(load_file(str(path)), layer)
        with torch.no_grad():
            for k, v in rewritten.items():
                originals[k] = params[k].detach().to(scale_dtype).clone()
                params[k].copy_(v.float())
        for members in layer.groups:
            for t in members:
                ptq = weights.pop(t.name)
                lin = model.get_submodule(t.name)
                g_idx = ptq.columns()  # [in] column -> group
                latent = latent_init(lin.weight.float(), ptq.weight, ptq.scale[:, g_idx]) if nudge else ptq.weight
                fmt = QATFormat(t.scheme.weights, t.scheme.activations, st.scales == "learned", scale_dtype)
                q = QATLinear(latent, lin.bias, ptq.scale, ptq.zero_point, g_idx, fmt)
                if not torch.equal(q.export()[0], ptq.weight):
                    raise QATError(f"{t.name}: the QAT start does not reproduce the PTQ weights (internal error)")
                q.keep_float(lin.weight, originals.get(t.name + ".bias", lin.bias), scale_dtype)
                model.set_submodule(t.name, q)
                modules[t.name] = q
    model.to(run.device)
    return model, modules, Teacher(model, modules, {k: v.to(run.device) for k, v in originals.items()})


class Teacher:
    """The float model's forward, computed by the student's own module tree: every QATLinear in teacher
    mode (its original weight, no fake quantization) and every non-quantized tensor a transform rewrote
    (a folded norm weight) swapped back to its stored value for the call. No second model in memory."""

    def __init__(self, student: nn.Module, modules: dict[str, QATLinear], originals: dict[str, torch.Tensor]):
        self.student, self.modules = student, modules
        bias_names = {n + ".bias" for n in modules}
        self.originals = {k: v for k, v in originals.items() if k not in bias_names}  # QATLinear keeps its own

    @torch.no_grad()
    def __call__(self, **kwargs):
        params = dict(self.student.named_parameters())
        saved = {k: params[k].detach().clone() for k in self.originals}
        was_training = self.student.training
        self.student.eval()
        for m in self.modules.values():
            m.as_teacher = True
        try:
            for k, v in self.originals.items():
                params[k].copy_(v.float())
            return self.student(**kwargs)
        finally:
            for k, v in saved.items():
                params[k].copy_(v)
            for m in self.modules.values():
                m.as_teacher = False
            self.student.train(was_training)


def trainable(modules: dict[str, QATLinear]) -> dict[str, nn.Parameter]:
    out = {}
    for name, m in modules.items():
        out[f"{name}.weight"] = m.weight
        if m.learn_scale:
            out[f"{name}.weight_scale"] = m.weight_scale
    return out


# ----------------------------------------------------------------------------------------------- loss
def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_logp: bool = False) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) on [b, L, vocab] logits (or the teacher's log-probabilities
    when `teacher_logp`)."""
    v = student_logits.shape[-1]
    ls = F.log_softmax(student_logits.float().reshape(-1, v), dim=-1)  # [b*L, vocab]
    lt = teacher_logits.float().reshape(-1, v)
    lt = lt if teacher_logp else F.log_softmax(lt, dim=-1)  # [b*L, vocab]
    return F.kl_div(ls, lt, log_target=True, reduction="batchmean")


@dataclass
class TopK:
    """The teacher's k most likely next tokens at each position and the log-probability of everything else."""
    index: torch.Tensor  # [..., L, k] int32 token ids
    logp: torch.Tensor   # [..., L, k] fp32 log-probabilities (full-vocabulary softmax)
    tail: torch.Tensor   # [..., L] fp32 log of the probability mass outside the k tokens

    @staticmethod
    def of(logits: torch.Tensor, k: int) -> "TopK":
        lp = F.log_softmax(logits.float(), dim=-1)  # [..., L, vocab]
        top, idx = lp.topk(min(k, lp.shape[-1] - 1), dim=-1)  # at least one token stays in the tail
        return TopK(idx.to(torch.int32), top, torch.logsumexp(lp.scatter(-1, idx, float("-inf")), dim=-1))

    def mass(self) -> float:
        """Mean share of the probability that the k tokens hold."""
        return float(self.logp.exp().sum(-1).mean())


def kd_topk_loss(student_logits: torch.Tensor, t: TopK) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) between the two distributions coarsened to k + 1 outcomes:
    the teacher's k most likely tokens, and the rest of the vocabulary as one. It equals the full KL when the
    teacher's top k hold all its mass and is never above it (coarsening loses information), so it trains the
    student's ranking of the likely tokens exactly and only the total of the unlikely ones."""
    v, k = student_logits.shape[-1], t.index.shape[-1]
    ls = F.log_softmax(student_logits.float().reshape(-1, v), dim=-1)  # [N, vocab]
    idx = t.index.reshape(-1, k).long()  # [N, k]
    ls_k = ls.gather(1, idx)  # [N, k]
    ls_tail = torch.logsumexp(ls.scatter(1, idx, float("-inf")), dim=1)  # [N]
    lt_k, lt_tail = t.logp.reshape(-1, k), t.tail.reshape(-1)
    kl = (lt_k.exp() * (lt_k - ls_k)).sum(1) + lt_tail.exp() * (lt_tail - ls_tail)  # [N]
    return kl.mean()


class TeacherTargets:
    """The teacher's top-k targets per training window, computed once and reused every time the window is
    drawn again: a window's teacher output does not change during training. `precompute` fills the cache in
    one batched pass, in a fixed order (when the run draws at least as many windows as there are); otherwise
    `get` computes a window on its own the first time it is drawn. Either way a window's targets do not
    depend on what was computed before, so a resumed run trains on the same targets. Memory: k * 8 + 4 bytes
    per token (~130 KB per 256-token window at k = 64)."""

    def __init__(self, teacher, train: list[torch.Tensor], k: int, autocast: torch.dtype | None):
        self.teacher, self.train, self.k, self.autocast = teacher, train, k, autocast
        self.cache: dict[tuple[int, int], TopK] = {}
        self.seconds = 0.0

    def _compute(self, keys: list[tuple[int, int]], device: torch.device) -> None:
        t0 = time.perf_counter()
        ids = micro_batch(self.train, keys).to(device)
        ctx = torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            top = TopK.of(self.teacher(input_ids=ids, use_cache=False).logits, self.k)  # [b, L, k]
        for j, key in enumerate(keys):
            self.cache[key] = TopK(top.index[j].cpu(), top.logp[j].cpu(), top.tail[j].cpu())
        self.seconds += time.perf_counter() - t0

    def precompute(self, device: torch.device, batch: int, quiet: bool) -> None:
        keys = [(s, r) for s, t in enumerate(self.train) for r in range(len(t)) if (s, r) not in self.cache]
        for i in tqdm(range(0, len(keys), batch), desc="qat teacher", unit="batch", disable=quiet or not keys):
            self._compute(keys[i:i + batch], device)

    def get(self, keys: list[tuple[int, int]], device: torch.device) -> TopK:
        for key in dict.fromkeys(k for k in keys if k not in self.cache):
            self._compute([key], device)
        rows = [self.cache[k] for k in keys]
        return TopK(torch.stack([r.index for r in rows]).to(device), torch.stack([r.logp for r in rows]).to(device),
                    torch.stack([r.tail for r in rows]).to(device))

    def summary(self) -> dict:
        mass = [float(t.logp.exp().sum(-1).mean()) for t in self.cache.values()]
        return {"topk": self.k, "windows_cached": len(self.cache), "teacher_s": round(self.seconds, 2),
                "topk_mass_mean": round(sum(mass) / len(mass), 4) if mass else None}


def ce_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, v), ids[:, 1:].reshape(-1))  # [b*(L-1), vocab]


def step_loss(student, teacher, ids: torch.Tensor, kind: str, autocast: torch.dtype | None = None,
              targets: TopK | None = None) -> torch.Tensor:
    """One micro-batch's loss; the forwards run under autocast to `autocast` when given (the loss is fp32).
    With `targets` (the teacher's cached top-k for these windows) kd needs no teacher forward."""
    ctx = torch.autocast(ids.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with ctx:
        if kind == "kd" and targets is None:  # first: the teacher swaps folded norm weights in and out, which
            with torch.no_grad():  # must not happen while the student's graph holds them
                t = teacher(input_ids=ids, use_cache=False).logits
        logits = student(input_ids=ids, use_cache=False).logits
    if kind == "ce":
        return ce_loss(logits, ids)
    return kd_topk_loss(logits, targets) if targets is not None else kd_loss(logits, t)


HELDOUT_CACHE_BYTES = 1 << 30  # the teacher's held-out log-probabilities are kept in memory up to this size


class HeldOut:
    """The held-out windows, and the float teacher's log-probabilities on them (full vocabulary, fp32),
    computed at the first evaluation and kept when they fit in HELDOUT_CACHE_BYTES (else recomputed)."""

    def __init__(self, windows: torch.Tensor):
        self.windows = windows  # [m, L]
        self._teacher: list[torch.Tensor] | None = None

    @torch.no_grad()
    def evaluate(self, student, teacher) -> dict:
        """Held-out KL to the teacher and next-token loss (exact, fp32), one window at a time."""
        device = next(student.parameters()).device
        was = student.training
        student.eval()
        kl = ce = 0.0
        keep = self._teacher is None and self.windows.numel() * student.config.vocab_size * 4 <= HELDOUT_CACHE_BYTES
        fresh = []
        for i, row in enumerate(self.windows):
            ids = row.unsqueeze(0).to(device)  # [1, L]
            if self._teacher is not None:
                lt = self._teacher[i].to(device)
            else:
                lt = F.log_softmax(teacher(input_ids=ids, use_cache=False).logits.float(), dim=-1)  # [1, L, vocab]
                if keep:
                    fresh.append(lt.cpu())
            s = student(input_ids=ids, use_cache=False).logits
            kl += float(kd_loss(s, lt, teacher_logp=True))
            ce += float(ce_loss(s, ids))
        if keep:
            self._teacher = fresh
        student.train(was)
        return {"kl": kl / len(self.windows), "ce": ce / len(self.windows)}




def lr_at(step: int, st: QATStage) -> float:
    """Linear warmup to `lr`, then cosine decay to 0 at `steps` (step counts from 0)."""
    if step < st.warmup_steps:
        return st.lr * (step + 1) / st.warmup_steps
    t = (step - st.warmup_steps) / max(1, st.steps - st.warmup_steps)
    return st.lr * 0.5 * (1 + math.cos(math.pi * t))


# ----------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(root: Path, step: int, params: dict[str, nn.Parameter], opt: torch.optim.Optimizer,
                    state: dict) -> None:
    tensors = {}
    for n, p in params.items():
        tensors[f"param/{n}"] = p.detach().contiguous()
        s = opt.state.get(p)
        if s:
            tensors[f"exp_avg/{n}"] = s["exp_avg"].contiguous()
            tensors[f"exp_avg_sq/{n}"] = s["exp_avg_sq"].contiguous()
            tensors[f"step/{n}"] = torch.as_tensor(s["step"], dtype=torch.float32).reshape(1)  # [] -> [1]
    name = f"ckpt-{step:06d}.safetensors"
    tmp = root / f".{name}.tmp"
    save_file(tensors, str(tmp), metadata={"step": str(step)})
    os.replace(tmp, root / name)
    atomic_write_json(root / "state.json", {**state, "step": step, "checkpoint": name})
    best = (state.get("best") or {}).get("file")
    for old in [*root.glob("ckpt-*.safetensors"), *root.glob("best-*.safetensors")]:
        if old.name not in (name, best):
            old.unlink()


def save_best(root: Path, step: int, params: dict[str, nn.Parameter]) -> str:
    """The trainable tensors at the best evaluation so far, as `best-<step>.safetensors` (temporary name, then
    renamed); state.json names it at the next checkpoint, which then removes the older ones."""
    name = f"best-{step:06d}.safetensors"
    tmp = root / f".{name}.tmp"
    save_file({n: p.detach().contiguous() for n, p in params.items()}, str(tmp), metadata={"step": str(step)})
    os.replace(tmp, root / name)
    return name


def load_checkpoint(root: Path, params: dict[str, nn.Parameter], opt: torch.optim.Optimizer) -> dict | None:
    import json

    sp = root / "state.json"
    if not sp.is_file():
        return None
    state = json.loads(sp.read_text())
    tensors = load_file(str(root / state["checkpoint"]))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"param/{n}"])
            if f"exp_avg/{n}" in tensors:
                opt.state[p] = {"step": tensors[f"step/{n}"].reshape(()).clone(),  # [1] -> []
                                "exp_avg": tensors[f"exp_avg/{n}"].clone(),
                                "exp_avg_sq": tensors[f"exp_avg_sq/{n}"].clone()}
    return state


# ------------------------------------------------------------------------------------------------ run
@dataclass
class Training:
    """What every optimizer step of one run works with: the student and its teacher, the trainable QAT
    modules, the stage config and the training windows (per source, with the sources' weights). `train`
    adds the optimizer, the autocast dtype and the teacher's cached targets."""

    student: nn.Module
    teacher: "Teacher"
    modules: dict[str, QATLinear]
    st: QATStage
    train_w: list[torch.Tensor]
    weights: list[float]
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    opt: torch.optim.Optimizer | None = None
    autocast: torch.dtype | None = None
    targets: TeacherTargets | None = None  # kd from the teacher's cached top-k instead of a teacher forward

    def __post_init__(self):
        self.params = self.params or trainable(self.modules)
        if self.opt is None:
            self.opt = torch.optim.AdamW(list(self.params.values()), lr=self.st.lr, betas=BETAS, weight_decay=0.0)


def optimizer_step(tr: Training, step: int) -> float:
    """One optimizer step over `grad_accum` micro-batches; returns the step's loss."""
    st = tr.st
    device = next(tr.student.parameters()).device
    for g in tr.opt.param_groups:
        g["lr"] = lr_at(step, st)
    tr.opt.zero_grad(set_to_none=True)
    total = 0.0
    for m in tr.modules.values():  # fake-quantize each weight once per step, not once per micro-batch
        m.begin_step()
    try:
        for micro in range(st.grad_accum):
            keys = micro_rows(tr.train_w, tr.weights, st.seed, step, micro, st.batch_size)
            ids = micro_batch(tr.train_w, keys).to(device)
            top = tr.targets.get(keys, device) if tr.targets is not None else None
            loss = step_loss(tr.student, tr.teacher, ids, st.loss, tr.autocast, top) / st.grad_accum
            loss.backward()
            total += float(loss.detach())
        pairs = [p for p in (m.end_step() for m in tr.modules.values()) if p is not None]
    finally:
        for m in tr.modules.values():
            m.end_step()
    if pairs:  # the accumulated gradients, through the fake quantization (STE / LSQ) once
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    torch.nn.utils.clip_grad_norm_(list(tr.params.values()), MAX_GRAD_NORM)
    tr.opt.step()
    return total


def judge(best: float, waited: int, value: float, min_delta: float) -> tuple[bool, int]:
    """One held-out evaluation against the best so far: (is it the new best, evaluations waited since the last
    improvement by more than `min_delta`). The weights kept are always those of the lowest loss; `min_delta`
    only decides what counts as progress for the early-stop patience."""
    return value < best, 0 if value < best - min_delta else waited + 1


def train(tr: Training, heldout: torch.Tensor, root: Path, quiet: bool = False) -> dict:
    """Train, evaluating on the held-out windows every `eval_every` steps; stop early when the stage's
    `early_stop` rule says so; put the trainable tensors of the best evaluation back at the end."""
    from quantkit.hardware import compute_dtype

    st, student = tr.st, tr.student
    device = next(student.parameters()).device
    dtype, why = compute_dtype(st.compute_dtype, device, field="the qat stage's compute_dtype")
    tr.autocast = torch.bfloat16 if dtype == "bfloat16" else None
    log.info("qat: forward in %s (%s)", dtype, why)
    state = load_checkpoint(root, tr.params, tr.opt) or {"step": 0, "train_loss": [], "eval": [], "wall_time_s": 0.0,
                                                         "best": None, "stopped": None}
    start = state["step"]
    resumed = start or None
    if start:
        log.info("qat: resuming after step %d", start)
    held = HeldOut(heldout)
    tr.targets = TeacherTargets(tr.teacher, tr.train_w, st.teacher_topk, tr.autocast) \
        if st.loss == "kd" and st.teacher_topk else None
    t0 = time.perf_counter() - state["wall_time_s"]
    if not state["eval"]:  # the PTQ start: the weights to keep if training never beats it
        e = held.evaluate(student, tr.teacher)
        state["eval"].append({"step": 0, **e})
        state["best"] = {"step": 0, _key(st): e[_key(st)], "waited": 0, "file": save_best(root, 0, tr.params)}
    draws = st.steps * st.grad_accum * st.batch_size  # the whole run's, so a resumed run decides the same
    if tr.targets is not None and not state["stopped"] and draws >= sum(len(t) for t in tr.train_w):
        tr.targets.precompute(device, st.batch_size * st.grad_accum, quiet)  # every window is drawn anyway
    if st.gradient_checkpointing and hasattr(student, "gradient_checkpointing_enable"):
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.train()
    _steps(tr, held, state, start, t0, root, quiet)
    if st.gradient_checkpointing and hasattr(student, "gradient_checkpointing_disable"):
        student.gradient_checkpointing_disable()
    student.eval()
    _keep_best(tr, state, root)
    state["resumed_at_step"] = resumed
    state["compute_dtype"], state["compute_dtype_reason"] = dtype, why
    state["teacher"] = tr.targets.summary() if tr.targets is not None else {"topk": 0}
    return state


def _key(st: QATStage) -> str:
    """The held-out loss that decides: KL to the float model for kd, next-token loss for ce."""
    return "kl" if st.loss == "kd" else "ce"


def _steps(tr: Training, held: "HeldOut", state: dict, start: int, t0: float, root: Path, quiet: bool) -> None:
    """The optimizer steps from `start` on, with the held-out evaluations, early stop and checkpoints."""
    st, key = tr.st, _key(tr.st)
    todo = [] if state["stopped"] else range(start, st.steps)
    bar = tqdm(todo, desc="qat", unit="step", disable=quiet, initial=start, total=st.steps)
    for step in bar:
        total = optimizer_step(tr, step)
        state["train_loss"].append(round(total, 6))
        done = step + 1
        if done % st.eval_every == 0 or done == st.steps:
            _evaluate(tr, held, state, done, root)
        bar.set_postfix_str(f"loss {total:.4f}, held-out {key} {state['eval'][-1][key]:.4f} "
                            f"(best {state['best'][key]:.4f} at {state['best']['step']})")
        log.info("qat step %d/%d: loss %.5f lr %.3g", done, st.steps, total, lr_at(step, st))
        state["wall_time_s"] = round(time.perf_counter() - t0, 2)
        if done % st.checkpoint_every == 0 or done == st.steps or state["stopped"]:
            save_checkpoint(root, done, tr.params, tr.opt, state)
        if state["stopped"]:
            log.info("qat: stopped early at step %d: %s", done, state["stopped"]["reason"])
            break


def _evaluate(tr: Training, held: "HeldOut", state: dict, done: int, root: Path) -> None:
    """One held-out evaluation after step `done`: keep the best weights, decide on an early stop."""
    st, key = tr.st, _key(tr.st)
    min_delta = st.early_stop.min_delta if st.early_stop else 0.0
    e = held.evaluate(tr.student, tr.teacher)
    state["eval"].append({"step": done, **e})
    best = state["best"]
    lower, waited = judge(best[key], best["waited"], e[key], min_delta)
    if lower:
        state["best"] = {"step": done, key: e[key], "waited": waited, "file": save_best(root, done, tr.params)}
    else:
        best["waited"] = waited
    best = state["best"]
    if st.early_stop and best["waited"] >= st.early_stop.patience:
        state["stopped"] = {
            "step": done, "reason": f"held-out {key} did not fall by more than {min_delta:g} in "
                                    f"{best['waited']} evaluations (best {best[key]:.5f} at step {best['step']})"}


def _keep_best(tr: Training, state: dict, root: Path) -> None:
    best, key = state["best"], _key(tr.st)
    if best["step"] != state["eval"][-1]["step"]:  # the last evaluation is not the best: go back to the best
        log.info("qat: keeping step %d (held-out %s %.5f), not the last", best["step"], key, best[key])
        tensors = load_file(str(root / best["file"]))
        with torch.no_grad():
            for n, p in tr.params.items():
                p.copy_(tensors[n])


def run(ctx: FinetuneRun, layer_files: list[Path], root: Path) -> QATResult:
    """Train the plan's fine-tune stage from the PTQ layer files; write the export tensors into `root`."""
    plan = ctx.plan
    st: QATStage = plan.finetune.config
    root.mkdir(parents=True, exist_ok=True)
    train_w, weights, heldout = split_windows(plan.calibration.spec, ctx.tokenizer, st.seq_len, st.holdout_fraction,
                                              st.seed)
    heldout = heldout[:st.eval_samples]
    log.info("qat: %d training windows, %d held-out windows of %d tokens",
             sum(len(t) for t in train_w), len(heldout), st.seq_len)
    student, modules, teacher = build_student(ctx, layer_files)
    state = train(Training(student, teacher, modules, st, train_w, weights), heldout, root, ctx.quiet)

    files = write_results(plan, layer_files, modules, root / "layers", ctx.on_weight)
    plot = plot_losses(state, st, root / "qat_loss.png")
    first, last = state["eval"][0], state["eval"][-1]
    kept = next(e for e in state["eval"] if e["step"] == state["best"]["step"])
    summary = {
        "starts_from": sorted({t.quantizer.name for t in plan.targets.values()}),  # the quantizers of the PTQ start
        "steps": st.steps, "loss": st.loss, "scales": st.scales, "lr": st.lr, "warmup_steps": st.warmup_steps,
        "batch_size": st.batch_size, "seq_len": st.seq_len, "grad_accum": st.grad_accum, "seed": st.seed,
        "tokens_trained": len(state["train_loss"]) * st.grad_accum * st.batch_size * st.seq_len,
        "train_windows": sum(len(t) for t in train_w), "heldout_windows": len(heldout),
        "heldout_before": first, "heldout_after": kept, "heldout_last": last, "eval": state["eval"],
        "train_loss": state["train_loss"], "eval_every": st.eval_every, "kept_step": state["best"]["step"],
        "steps_trained": len(state["train_loss"]),
        "early_stop": st.early_stop.model_dump() if st.early_stop else None, "stopped_early": state["stopped"],
        "teacher": state["teacher"],
        "wall_time_s": state["wall_time_s"], "resumed_at_step": state.get("resumed_at_step"),
        "compute_dtype": state["compute_dtype"], "compute_dtype_reason": state["compute_dtype_reason"],
        "gradient_checkpointing": st.gradient_checkpointing,
        "modules": len(modules),
    }
    log.info("qat done: held-out KL %.5f -> %.5f, CE %.4f -> %.4f (step %d kept) in %.1fs", first["kl"], kept["kl"],
             first["ce"], kept["ce"], kept["step"], state["wall_time_s"])
    return QATResult(files, summary, [plot] if plot else [])


def write_results(plan: Plan, layer_files: list[Path], modules: dict[str, QATLinear], out_dir: Path,
                  on_weight=None) -> list[Path]:
    """The trained modules as typed layer files in `out_dir`, in the work folder's form: the PTQ layer
    file's float tensors a transform rewrote go out as the pipeline stored them, and g_idx where the PTQ
    result carried one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for layer, path in zip(plan.layers, layer_files):
        typed, rewritten = split_layer(load_file(str(path)), layer)
        results = []
        for t in layer.targets:
            m = modules[t.name]
            deq, scale, zp = m.export()
            g_idx = m.g_idx.cpu() if f"{t.name}.g_idx" in typed else None
            results.append(ModuleResult(t.name, {}, QuantizedWeight(deq.cpu(), scale.cpu(), zp.cpu() if zp is not None else None,
                                                                    g_idx), t.scheme.weights))
            if on_weight is not None:
                on_weight(t.name, deq.cpu().clone())
        if results:
            results[0].rewritten.update(rewritten)
        elif rewritten:
            raise QATError(f"layer {layer.index}: float tensors were rewritten but no module is quantized (internal error)")
        save_typed(out_dir / path.name, results)
        files.append(out_dir / path.name)
    return files


def plot_losses(state: dict, st: QATStage, path: Path) -> Path | None:
    """Training loss per step and held-out loss at each evaluation, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(range(1, len(state["train_loss"]) + 1), state["train_loss"], lw=0.8, alpha=0.6,
            label="train (" + ("next-token CE" if st.loss != "kd" else "KL to float" if not st.teacher_topk
                               else f"KL to float, top-{st.teacher_topk} + rest") + ")")
    key = "kl" if st.loss == "kd" else "ce"
    ax.plot([e["step"] for e in state["eval"]], [e[key] for e in state["eval"]], "o-", label=f"held-out {key}")
    best = state.get("best")
    if best:
        ax.axvline(best["step"], color="green", ls="--", lw=1, label=f"kept: step {best['step']}")
    if state.get("stopped"):
        ax.axvline(state["stopped"]["step"], color="red", ls=":", lw=1, label=f"stopped early: step {state['stopped']['step']}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"QAT: {st.scheme}, lr {st.lr:g}, {st.scales} scales")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
