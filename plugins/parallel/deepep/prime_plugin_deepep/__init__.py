"""prime-plugin-deepep: DeepEP dispatch/combine kernels as an expert-parallel backend."""
