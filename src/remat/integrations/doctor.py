"""Where the doctor was first documented, ``from remat.integrations.doctor import doctor``; it stays
importable from here. The doctor is a diagnosis, not an integration: it lives in :mod:`remat.diagnosis`."""
from remat.diagnosis import Finding, doctor

__all__ = ["Finding", "doctor"]
