"""fp contraction, named at every kernel launch.

Triton fuses a multiply and the add that takes its result into one fma unless a launch says
otherwise (`enable_fp_fusion`). Left unset, the installed Triton's default decides: on up to
Triton 3.9, which then warns once a process that it was unset (a UserWarning on every GPU
command's stderr), and off from Triton 3.10. A kernel's output bits follow that choice, so no
launch here leaves it unset:
- FUSED for every kernel measured with contraction on: Triton 3.6's default, under which each
  GPU figure and bitwise check in benchmarks/results/ was taken;
- False, written at the launch, where a kernel matches torch's operation-by-operation
  rounding (adamw.py, rmsnorm.py, rope.py).
TRITON_FORCE_DISABLE_FP_FUSION=1 still turns contraction off for every launch (Triton's own
override, for a user who asks for it).
"""

FUSED = True
