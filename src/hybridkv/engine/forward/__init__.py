"""One forward pass over the cache: the cache tensors as planned, the block tables on
the device, junction copies, and the runner that builds a step's batch and runs a model."""
