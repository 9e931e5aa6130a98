"""Tensor parallelism over torch.distributed: one model across several devices of one host
(docs/tensor_parallel.md)."""

from hf_paged.distributed.executor import TensorParallelExecutor, check_tensor_parallel

__all__ = ["TensorParallelExecutor", "check_tensor_parallel"]
