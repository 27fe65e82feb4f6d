"""How much of its PTQ start's perplexity gap a QAT recipe recovers, and what it costs. Prints JSON.

Converts the recipe twice, as a user would: its PTQ start (the stages before `qat`; round-to-nearest with
the qat stage's scheme when there are none) and the whole recipe, timed. Then scores the float model, the
PTQ start and the QAT result with transformers (fp32, engine-free) on two kinds of held-out text:
  - the recipe's own held-out split: every window QAT held out of its calibration sources (never trained on)
  - calibration/heldout/technical.txt and general.txt: text outside the calibration corpus
recovered = (ppl_start - ppl_qat) / (ppl_start - ppl_float), the share of the start's gap QAT closes. The
manifest's held-out KL at each evaluation gives the curve (KL to the float model is 0 at full recovery).

    .venv/bin/python benchmarks/qat.py                       # the shipped recipe, ~17 min on 2 cores
    .venv/bin/python benchmarks/qat.py --set 'stages[1].steps=40'
    .venv/bin/python benchmarks/qat.py --recipe my-w8a8-qat.yaml  # any recipe whose last stage is qat
    .venv/bin/python benchmarks/qat.py --step-time           # seconds per optimizer step, the shipped recipe's shape

--step-time times `quantkit.quantize.finetune.optimizer_step` alone (the training loop's step: micro-batches, the
teacher or its cached top-k targets, the backward, AdamW) on the demo model with RTN W4A16 QATLinears,
with the shipped QAT recipe's batch shape unless overridden, after one warm-up step. With top-k targets
(the recipe's default) the teacher's pass over the windows runs first and is reported per window.

Anchor: torchao reports QAT recovering about 40% of the int4 perplexity gap on gemma3-4b.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHIPPED = REPO / "recipes" / "smollm2-w4a16-gptq-qat.yaml"
HELDOUT_FILES = [REPO / "calibration" / "heldout" / "technical.txt", REPO / "calibration" / "heldout" / "general.txt"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(os.environ.get("QUANTKIT_HOME", Path.home() / ".cache" / "quantkit"))
                                           / "models" / "smollm2-135m"))
    ap.add_argument("--recipe", default=str(SHIPPED), help="a recipe whose last stage is qat")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="tokens scored per held-out file")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--step-time", action="store_true", help="time optimizer steps only (see above)")
    ap.add_argument("--batch-size", type=int, default=None, help="step-time: default the shipped recipe's")
    ap.add_argument("--seq-len", type=int, default=None, help="step-time: default the shipped recipe's")
    ap.add_argument("--grad-accum", type=int, default=None, help="step-time: default the shipped recipe's")
    ap.add_argument("--group-size", type=int, default=64, help="step-time: the RTN students' group size")
    ap.add_argument("--timed-steps", type=int, default=3)
    ap.add_argument("--compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--teacher-topk", type=int, default=None,
                    help="step-time: the kd targets' k (0 = the teacher's forward in every step; default: the recipe's)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.step_time:
        return step_time(args)
    recovery(args)


def recovery(args) -> None:
    import yaml

    from quantkit import api
    from quantkit.evaluate.hf_perplexity import load_for_perplexity, perplexity, window_nll
    from quantkit.hardware import hardware
    from quantkit.quantize.finetune import split_windows
    from quantkit.recipe import load_recipe

    os.chdir(REPO)  # the shipped recipes name calibration/ relative to the repository root
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-qat-bench-"))
    full = load_recipe(Path(args.recipe), [f"model.path={args.model}", *args.set])
    st = full.stages[-1]
    if st.method != "qat":
        raise SystemExit(f"{args.recipe}: the last stage is {st.method!r}, not qat")
    before = [s.model_dump(exclude_defaults=True) | {"method": s.method} for s in full.stages[:-1]] or \
        [{"method": "rtn", "scheme": st.scheme, "group_size": st.group_size, "targets": st.targets, "ignore": st.ignore}]
    ptq = load_recipe(Path(args.recipe), [f"model.path={args.model}", *args.set, f"name={full.name}-start",
                                          f"stages={yaml.safe_dump(before, default_flow_style=True).strip()}"])

    res: dict = {"recipe": os.path.relpath(args.recipe, REPO), "overrides": args.set, "threads": args.threads}
    t0 = time.perf_counter()
    start_dir = api.convert(ptq, work / "start", quiet=True, overwrite=True)
    res["start_convert_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    qat_dir = api.convert(full, work / "qat", quiet=True, overwrite=True)
    res["recipe_wall_s"] = round(time.perf_counter() - t0, 1)
    man = json.loads((qat_dir / "manifest.json").read_text())["qat"]

    tok = None
    texts: dict[str, dict] = {}
    for label, folder in (("float", Path(args.model)), ("start", start_dir), ("qat", qat_dir)):
        model, tok = load_for_perplexity(folder)
        if "split" not in texts:
            _, _, held = split_windows(full.calibration, tok, st.seq_len, st.holdout_fraction, st.seed)
            texts["split"] = {"windows": list(held)}
        nll, n = window_nll(model, texts["split"]["windows"])
        texts["split"][label] = math.exp(nll / n)
        texts["split"]["tokens"] = n
        per = perplexity(model, tok, HELDOUT_FILES, max_tokens=args.ppl_tokens)["per_file"]
        for name, v in per.items():
            texts.setdefault(name, {})[label] = v
        del model
    rows = {}
    for name, t in texts.items():
        rows[name] = {k: round(t[k], 4) for k in ("float", "start", "qat")}
        rows[name]["recovered"] = round((t["start"] - t["qat"]) / (t["start"] - t["float"]), 4)
        if "tokens" in t:
            rows[name]["tokens"] = t["tokens"]
    res["perplexity"] = {"recipe_heldout_split" if k == "split" else k: v for k, v in rows.items()}
    kl0 = man["eval"][0]["kl"]
    res["qat"] = {k: man[k] for k in ("steps", "steps_trained", "kept_step", "stopped_early", "early_stop", "lr",
                                      "batch_size", "seq_len", "grad_accum", "tokens_trained", "teacher",
                                      "compute_dtype", "wall_time_s")}
    res["heldout_curve"] = [{"step": e["step"], "kl": round(e["kl"], 5), "ce": round(e["ce"], 5),
                             "kl_recovered": round(1 - e["kl"] / kl0, 4)} for e in man["eval"]]
    res["loss_curve_png"] = str(qat_dir / "qat_loss.png")
    res["hardware"] = hardware()
    print(json.dumps(res, indent=2))


def step_time(args) -> None:
    import torch
    import yaml

    from quantkit.quantize import finetune as qat
    from quantkit.algorithms.qat import QATFormat, QATLinear, QATStage
    from quantkit.algorithms.rtn import rtn
    from quantkit.hardware import compute_dtype, hardware
    from quantkit.recipe import load_recipe
    from quantkit.schemes import get_scheme

    torch.set_num_threads(args.threads) if args.threads else None
    shipped = load_recipe(REPO / "recipes" / "smollm2-w4a16-gptq-qat.yaml").stages[-1]
    given = {k: v for k, v in {"batch_size": args.batch_size, "seq_len": args.seq_len,
                               "grad_accum": args.grad_accum}.items() if v is not None}
    st = QATStage(**{**shipped.model_dump(), **given, "compute_dtype": args.compute_dtype,
                     "gradient_checkpointing": args.gradient_checkpointing,
                     **({"teacher_topk": args.teacher_topk} if args.teacher_topk is not None else {})})
    spec = get_scheme("W4A16").with_overrides(group_size=args.group_size).weights
    model = qat.load_float(Path(args.model))
    modules = {}
    for name, lin in list(model.named_modules()):
        if isinstance(lin, torch.nn.Linear) and not name.endswith("lm_head"):
            deq, qp = rtn(lin.weight.float(), spec, torch.bfloat16)
            m = QATLinear(deq, lin.bias, qp.scale, qp.zero_point, torch.arange(lin.in_features) // args.group_size,
                          QATFormat(spec, None, True, torch.bfloat16))
            m.keep_float(lin.weight, lin.bias, torch.bfloat16)
            model.set_submodule(name, m)
            modules[name] = m
    teacher = qat.Teacher(model, modules, {})
    if st.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    dtype, why = compute_dtype(st.compute_dtype, torch.device("cpu"))
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    n_windows = 16
    train = [torch.randint(0, model.config.vocab_size, (n_windows, st.seq_len), generator=torch.Generator().manual_seed(0))]
    targets = None
    if st.loss == "kd" and st.teacher_topk:  # as in a run that draws every window: the teacher's pass first
        targets = qat.TeacherTargets(teacher, train, st.teacher_topk, autocast)
        targets.precompute(torch.device("cpu"), st.batch_size * st.grad_accum, quiet=True)
    tr = qat.Training(model, teacher, modules, st, train, [1.0], autocast=autocast, targets=targets)
    times, losses = [], []
    for step in range(args.timed_steps + 1):
        t0 = time.perf_counter()
        losses.append(qat.optimizer_step(tr, step))
        times.append(time.perf_counter() - t0)
    tokens = st.batch_size * st.seq_len * st.grad_accum
    res = {"mode": "step-time", "batch_size": st.batch_size, "seq_len": st.seq_len, "grad_accum": st.grad_accum,
           "tokens_per_step": tokens, "compute_dtype": dtype, "compute_dtype_reason": why,
           "gradient_checkpointing": st.gradient_checkpointing, "threads": torch.get_num_threads(),
           "warmup_step_s": round(times[0], 3), "step_s": [round(t, 3) for t in times[1:]],
           "mean_step_s": round(sum(times[1:]) / args.timed_steps, 3),
           "train_tokens_per_s": round(tokens * args.timed_steps / sum(times[1:]), 1),
           "losses": [round(x, 5) for x in losses], "teacher_topk": st.teacher_topk if targets else 0,
           "teacher_precompute_s_per_window": round(targets.seconds / n_windows, 3) if targets else None,
           "hardware": hardware()}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
