"""The installed torch and transformers as ``(major, minor)``, for tests of behaviour one version lacks.

A test of something only newer releases have skips below them with a reason that names the
version and what is missing; a test whose outcome differs by version (a clear refusal on the
old one) asserts each outcome where it holds.
"""
import torch


def _pair(version: str) -> tuple:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH = _pair(torch.__version__)

try:
    import transformers
except ImportError:
    TRANSFORMERS = None
else:
    TRANSFORMERS = _pair(transformers.__version__)

TRANSFORMERS_4 = TRANSFORMERS is not None and TRANSFORMERS < (5, 0)
"""Transformers 4.x: MoE routing and BART's layer drop read tensor values, so fake-tensor profiles refuse them."""
