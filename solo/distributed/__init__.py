"""Tensor and expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs).

`parallel`: the process group state and the collectives; `sharding`: how each tensor is split;
`lockstep`: how the ranks run every request together (rank 0 leads, the others follow).
"""

from solo.distributed.parallel import TensorParallel, TensorParallelError, init_tensor_parallel

__all__ = ["TensorParallel", "TensorParallelError", "init_tensor_parallel"]
