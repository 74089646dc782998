"""The generation engine: phases on their plans' cores, continuous batching, tensor-parallel ranks."""
