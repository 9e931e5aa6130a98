"""hf_paged evals: accuracy and throughput of the paged engine side by side with transformers.

Run as `python evals/run.py ...`. The folder is loaded as the package `hf_paged_evals` (see run.py)
instead of being put on sys.path, so that no file here can shadow an installed package (such as
PyPI's `kernels`, which transformers probes for).
"""
