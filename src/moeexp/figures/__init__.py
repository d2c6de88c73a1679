"""Paper figures from ``results/`` only: one function per figure (see :mod:`.plots`)."""
