"""Python faces of the C++/CUDA ops. Layer 2: imports accelerator and op_builder only."""
