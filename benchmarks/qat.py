"""How much of the post-training-quantization gap QAT recovers, on SmolLM2-135M W4A16 (group 64). Prints JSON.

Held-out perplexity (transformers, calibration/heldout/technical.txt) of: the float model, PTQ RTN,
PTQ GPTQ (32 x 512 calibration tokens), and QAT started from RTN (default) or GPTQ (--start gptq),
trained with KL to the float model on the calibration sources (held-out split inside them).
recovered = (ppl_start - ppl_qat) / (ppl_start - ppl_float): the share of the starting PTQ gap closed.

    .venv/bin/python benchmarks/qat.py --steps 25            # ~10 min on a loaded 2-core CPU
    .venv/bin/python benchmarks/qat.py --steps 4 --no-gptq   # smoke run
    .venv/bin/python benchmarks/qat.py --step-time           # seconds per optimizer step, the shipped recipe's shape

--step-time times `quantkit.qat.optimizer_step` alone (the training loop's step: micro-batches, the
teacher, the backward, AdamW) on the demo model with RTN W4A16 QATLinears, with the shipped QAT recipe's
batch shape unless overridden, after one warm-up step.

Anchor: torchao reports QAT recovering about 40% of the int4 perplexity gap on gemma3-4b.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
HELDOUT = REPO / "calibration" / "heldout" / "technical.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(os.environ.get("QUANTKIT_HOME", Path.home() / ".cache" / "quantkit"))
                                           / "models" / "smollm2-135m"))
    ap.add_argument("--start", choices=["rtn", "gptq"], default="rtn", help="the PTQ result QAT starts from")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--scales", choices=["fixed", "learned"], default="learned")
    ap.add_argument("--loss", choices=["kd", "ce"], default="kd")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 1 (step-time: the shipped recipe's)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 256 (step-time: the shipped recipe's)")
    ap.add_argument("--grad-accum", type=int, default=None, help="default: 1 (step-time: the shipped recipe's)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--no-gptq", action="store_true", help="skip the GPTQ baseline (smoke runs)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--step-time", action="store_true", help="time optimizer steps only (see above)")
    ap.add_argument("--timed-steps", type=int, default=3)
    ap.add_argument("--compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from quantkit import api
    from quantkit.evaluate.hf_perplexity import load_for_perplexity, perplexity
    from quantkit.recipe import load_recipe

    if args.step_time:
        return step_time(args)
    args.batch_size, args.seq_len, args.grad_accum = args.batch_size or 1, args.seq_len or 256, args.grad_accum or 1
    os.chdir(REPO)  # the shipped recipe names calibration/ relative to the repository root
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-qat-bench-"))
    base = REPO / "recipes" / "smollm2-w4a16-gptq-qat.yaml"
    g = args.group_size
    ptq = {"rtn": f"{{method: rtn, scheme: W4A16, group_size: {g}}}",
           "gptq": f"{{method: gptq, scheme: W4A16, group_size: {g}, actorder: static}}"}
    qat_stage = (f"{{method: qat, scheme: W4A16, group_size: {g}, steps: {args.steps}, lr: {args.lr:.8f}, "
                 f"warmup_steps: {max(1, args.steps // 10)}, batch_size: {args.batch_size}, seq_len: {args.seq_len}, "
                 f"grad_accum: {args.grad_accum}, loss: {args.loss}, scales: {args.scales}, "
                 f"eval_every: {args.steps}, eval_samples: 4, checkpoint_every: {max(1, args.steps // 4)}}}")

    def convert(name: str, stages: str, samples: int) -> tuple[Path, float]:
        r = load_recipe(base, [f"model.path={args.model}", f"name={name}", f"stages={stages}",
                               f"calibration.num_samples={samples}"])
        t0 = time.perf_counter()
        out = api.convert(r, work / name, quiet=True, overwrite=True)
        return out, time.perf_counter() - t0

    def ppl(model_dir: Path) -> float:
        m, tok = load_for_perplexity(model_dir)
        return perplexity(m, tok, [HELDOUT], max_tokens=args.ppl_tokens)["perplexity"]

    res: dict = {"model": "SmolLM2-135M", "scheme": f"W4A16 group {g}", "heldout": HELDOUT.name,
                 "ppl_tokens": args.ppl_tokens, "threads": args.threads}
    res["ppl_float"] = ppl(Path(args.model))
    rtn_dir, res["rtn_convert_s"] = convert("rtn", f"[{ptq['rtn']}]", 32)
    res["ppl_rtn"] = ppl(rtn_dir)
    if not args.no_gptq:
        gptq_dir, res["gptq_convert_s"] = convert("gptq", f"[{ptq['gptq']}]", 32)
        res["ppl_gptq"] = ppl(gptq_dir)
    # QAT alone starts from RTN; the pipeline's calibration forward is not needed then, so keep it small
    stages = f"[{qat_stage}]" if args.start == "rtn" else f"[{ptq['gptq']}, {qat_stage}]"
    qat_dir, res["qat_convert_s"] = convert("qat", stages, 4 if args.start == "rtn" else 32)
    res["ppl_qat"] = ppl(qat_dir)
    man = json.loads((qat_dir / "manifest.json").read_text())["qat"]
    start = res[f"ppl_{args.start}"]
    res["qat"] = {"starts_from": args.start, "steps": args.steps, "lr": args.lr, "scales": args.scales,
                  "loss": args.loss, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "grad_accum": args.grad_accum, "tokens_trained": man["tokens_trained"],
                  "train_wall_s": man["wall_time_s"], "heldout_split_kl": [man["heldout_before"]["kl"],
                                                                          man["heldout_after"]["kl"]],
                  "train_loss_first_last": [man["train_loss"][0], man["train_loss"][-1]]}
    res["recovered_share_of_start_gap"] = round((start - res["ppl_qat"]) / (start - res["ppl_float"]), 4)
    if "ppl_gptq" in res:
        res["recovered_share_of_gptq_gap"] = round((res["ppl_gptq"] - res["ppl_qat"]) /
                                                   (res["ppl_gptq"] - res["ppl_float"]), 4)
    res["loss_curve"] = str(qat_dir / "qat_loss.png")
    from quantkit.hardware import hardware

    res["hardware"] = hardware()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}, indent=2))


def step_time(args) -> None:
    import torch
    import yaml

    from quantkit import qat
    from quantkit.algorithms.qat import QATLinear, QATStage
    from quantkit.algorithms.rtn import rtn
    from quantkit.hardware import compute_dtype, hardware
    from quantkit.recipe import load_recipe
    from quantkit.schemes import get_scheme

    torch.set_num_threads(args.threads) if args.threads else None
    shipped = load_recipe(REPO / "recipes" / "smollm2-w4a16-gptq-qat.yaml").stages[-1]
    given = {k: v for k, v in {"batch_size": args.batch_size, "seq_len": args.seq_len,
                               "grad_accum": args.grad_accum}.items() if v is not None}
    st = QATStage(**{**shipped.model_dump(), **given, "compute_dtype": args.compute_dtype,
                     "gradient_checkpointing": args.gradient_checkpointing})
    spec = get_scheme("W4A16").with_overrides(group_size=args.group_size).weights
    model = qat.load_float(Path(args.model), load_recipe(REPO / "recipes" / "smollm2-w4a16-gptq-qat.yaml",
                                                         [f"model.path={args.model}"]))
    modules = {}
    for name, lin in list(model.named_modules()):
        if isinstance(lin, torch.nn.Linear) and not name.endswith("lm_head"):
            deq, qp = rtn(lin.weight.float(), spec, torch.bfloat16)
            m = QATLinear(deq, lin.bias, qp.scale, qp.zero_point, torch.arange(lin.in_features) // args.group_size,
                          spec, None, True, torch.bfloat16)
            m.keep_float(lin.weight, lin.bias, torch.bfloat16)
            model.set_submodule(name, m)
            modules[name] = m
    teacher = qat.Teacher(model, modules, {})
    if st.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = qat.trainable(modules)
    opt = torch.optim.AdamW(list(params.values()), lr=st.lr, betas=qat.BETAS, weight_decay=0.0)
    dtype, why = compute_dtype(st.compute_dtype, torch.device("cpu"))
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    train = [torch.randint(0, model.config.vocab_size, (64, st.seq_len), generator=torch.Generator().manual_seed(0))]
    times, losses = [], []
    for step in range(args.timed_steps + 1):
        t0 = time.perf_counter()
        losses.append(qat.optimizer_step(model, teacher, modules, params, opt, st, train, [1.0], step, autocast))
        times.append(time.perf_counter() - t0)
    tokens = st.batch_size * st.seq_len * st.grad_accum
    res = {"mode": "step-time", "batch_size": st.batch_size, "seq_len": st.seq_len, "grad_accum": st.grad_accum,
           "tokens_per_step": tokens, "compute_dtype": dtype, "compute_dtype_reason": why,
           "gradient_checkpointing": st.gradient_checkpointing, "threads": torch.get_num_threads(),
           "warmup_step_s": round(times[0], 3), "step_s": [round(t, 3) for t in times[1:]],
           "mean_step_s": round(sum(times[1:]) / args.timed_steps, 3),
           "train_tokens_per_s": round(tokens * args.timed_steps / sum(times[1:]), 1),
           "losses": [round(x, 5) for x in losses], "hardware": hardware()}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
