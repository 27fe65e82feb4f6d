"""Build hook: ship the repository's recipes/, calibration/ and evals/ inside the wheel as package data.

The top-level folders stay the only copy in the repository; at build time they are copied into
`quantkit/_data/` of the build tree, where quantkit.resources finds them in an installed package.
Everything else about the package is in pyproject.toml.
"""

import ast
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent

def _shipped() -> tuple[str, ...]:
    """quantkit.resources.SHIPPED, read from the source (importing quantkit at build time would need its deps)."""
    tree = ast.parse((ROOT / "quantkit" / "resources.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHIPPED" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("setup.py: quantkit/resources.py defines no SHIPPED")


SHIPPED = _shipped()
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "tools")  # generators are not data


class BuildWithData(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the folders in place
            return
        dest = Path(self.build_lib) / "quantkit" / "_data"
        for name in SHIPPED:
            src = ROOT / name
            if not src.is_dir():  # building from an sdist that lacks them would ship a broken wheel
                raise SystemExit(f"setup.py: {src} is missing; build from a full checkout")
            shutil.rmtree(dest / name, ignore_errors=True)
            shutil.copytree(src, dest / name, ignore=SKIP)


setup(cmdclass={"build_py": BuildWithData})
