"""moegraph: CUDA-graph training of Mixture-of-Experts transformers (see README.md).

torch, imported without numpy, warns "Failed to initialize NumPy" (two lines on stderr) on
every command. moegraph never converts tensors to numpy, so that warning says nothing about
a moegraph run: it is silenced here, before any module imports torch, rather than adding
numpy as a dependency only to keep it quiet (and paying its import time on every command).
Only that message is filtered; every other warning still shows.
"""

import warnings

warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy", category=UserWarning)
