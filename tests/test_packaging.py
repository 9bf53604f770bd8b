"""What ``pip install remat`` gives a user with torch alone (issue 9): the package as built
(every layer folder included), with only its declared dependencies importable, can plan.

The test builds remat into a fresh folder with pip (``--no-deps``: nothing is downloaded),
then runs a Python that sees that folder, the standard library and the installed
distributions remat declares (and what they need) — never transformers, peft or anything
the test extras bring. A module remat imports but does not declare (numpy was one) fails
here with ModuleNotFoundError.
"""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PLAN_A_PLAIN_MODULE = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    import remat

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(32), nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = Net()
    x = torch.randn(8, 16, 32)
    plan = remat.plan(model, x, "1GiB", loss_fn=lambda m, b: m(b).square().mean())
    remat.apply(model, plan)
    model(x).square().mean().backward()
    assert "transformers" not in sys.modules and "peft" not in sys.modules
    print("planned", plan.summary())
""")


def _requirement_names(dist) -> list:
    names = []
    for requirement in dist.requires or ():
        if "extra ==" in requirement:
            continue
        names.append(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
    return names


def _closure(names) -> list:
    seen, todo = {}, list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue        # an environment marker excluded it (a platform-only dependency)
        seen[key] = dist
        todo.extend(_requirement_names(dist))
    return list(seen.values())


def _top_level(dist) -> set:
    """The names a distribution puts into site-packages (packages, modules, .libs folders)."""
    entries = set()
    for file in dist.files or ():
        first = file.parts[0]
        if first.endswith((".dist-info", ".egg-info")) or first in ("..", "__pycache__"):
            continue
        entries.add(first)
    return entries


def _old_build_backend():
    """Why pip cannot build remat here without isolation, or None: ``--no-build-isolation`` builds
    with this environment's setuptools, which must be the one pyproject's build-system asks for."""
    wanted = re.search(r'"setuptools>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    try:
        have = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        return "setuptools (remat's build backend) is not installed in this environment"
    if wanted and tuple(int(v) for v in have.split(".")[:2]) < tuple(int(v) for v in wanted.group(1).split(".")[:2]):
        return f"pyproject's build-system needs setuptools>={wanted.group(1)}; this environment has {have}"
    return None


def test_torch_only_install_can_plan_a_plain_module(tmp_path):
    if _old_build_backend():
        pytest.skip(_old_build_backend())
    source = tmp_path / "source"          # a copy: the build must not write into the checkout
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path / "site-remat"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, text=True)
    built = next(target.glob("remat-*.dist-info"))
    remat_dist = metadata.PathDistribution(built)
    declared = _requirement_names(remat_dist)
    assert "torch" in declared
    deps = tmp_path / "site-deps"
    deps.mkdir()
    for dist in _closure(declared):
        site = Path(dist.locate_file(""))
        for entry in _top_level(dist):
            if (site / entry).exists() and not (deps / entry).exists():
                os.symlink(site / entry, deps / entry)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{target}{os.pathsep}{deps}",
           "HOME": str(tmp_path)}
    # -S: no site-packages of this environment; only the two folders above and the stdlib
    result = subprocess.run([sys.executable, "-S", "-c", _PLAN_A_PLAIN_MODULE], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "planned" in result.stdout
    for package in ("treat", "offload", "profiling", "planning", "prove", "integrations", "cli"):
        assert (target / "remat" / package / "__init__.py").exists(), package
