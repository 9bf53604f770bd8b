"""The doctor: what is wrong with a training setup's memory and recomputation, worst first.

    from remat.diagnosis import doctor
    for finding in doctor(model, batch, training_args=args, budget="40GiB"):
        print(finding)

A diagnosis over the layers below it: it reads the model and its applied plan, runs one step,
profiles and plans with :mod:`remat.profiling` and :mod:`remat.planner`, and reports in
:class:`Finding` s. :mod:`~remat.diagnosis.checkup` holds the entry, :func:`doctor`, and the checks
that only read the setup (its docstring lists every check); :mod:`~remat.diagnosis.compile_checks`
the checks of how the model runs (compiled, per block, sharded) against what its plan was made for;
:mod:`~remat.diagnosis.run_checks` those that cost a step, a profile or a measurement;
:mod:`~remat.diagnosis.findings` what a finding is and the readings of the model the checks share,
so that every check imports it and no check imports the entry. :mod:`~remat.diagnosis.verification`
is :func:`remat.verify` (the untouched and the treated model on one batch, every gradient judged), which
the doctor runs for ``verify=True`` and the integrations and the command line may call.

Imports run one way: this package uses the API, the planner, profiling, planning, the treatments
and the head (:mod:`remat.head` also recognises TRL's fused head); it must never import the
integrations, the bench harness or the command line (:mod:`remat.integrations`, :mod:`remat.prove`,
:mod:`remat.cli`), which sit above it, and nothing below it imports it.
"""
from remat.diagnosis.checkup import doctor
from remat.diagnosis.findings import SEVERITIES, Finding
from remat.diagnosis.verification import Verification, verify

__all__ = ["SEVERITIES", "Finding", "Verification", "doctor", "verify"]
