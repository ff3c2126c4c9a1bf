"""CUDA kernel rules for attention: SDPA backend selection and each backend's saved tensors,
``nn.MultiheadAttention``'s fast and slow paths (see :mod:`memguard.estimator.cuda_kernels`)."""
