"""remat: make PyTorch training fit in GPU memory at the highest speed memory allows.

    import remat
    remat.apply(model, "full")                      # or "selective", "every:2", a Plan ...
    plan = remat.plan(model, batch, budget="24GiB")  # profile + simulate + solve
    remat.apply(model, plan)
    print(remat.verify(model, batch))                # its gradients against the untouched model's
    remat.remove(model)                              # back to the original modules

Importing remat imports neither torch nor transformers: the public names are resolved on
first use, so ``import remat`` and ``remat --help`` stay fast and never touch CUDA.
"""
from importlib import import_module

__version__ = "0.1.0"

_PUBLIC = {
    "apply": ".api",
    "remove": ".api",
    "current_plan": ".api",
    "Guard": ".guard",
    "Plan": ".planning.plans",
    "NoPlanFits": ".planning.solver",
    "discover": ".treat.discovery",
    "plan": ".planner",
    "auto": ".planner",
    "profile": ".profiling.profiler",
    "simulate": ".planning.simulator",
    "solve": ".planning.solver",
    "verify": ".diagnosis.verification",
}
# Module and folder names differ from the public function names on purpose: importing a
# submodule binds its name on the package, so a folder remat/profile/ would shadow
# remat.profile() (hence profiling/ and planning/).
__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
