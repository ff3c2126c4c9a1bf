"""CUDA kernel rules other than attention: dropout, losses, norms, embeddings, convolutions,
optimizers (see :mod:`memguard.estimator.cuda_kernels`)."""
