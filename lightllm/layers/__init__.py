"""What every model is built from: the attention backend, the per-step attention metadata and the TP collectives.

Imports only ``kernels`` and ``common``; models import from here, never from ``engine``."""
