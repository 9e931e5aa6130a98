"""Running a step on the device: model runner, input batch, CUDA graphs, compile, start-up,
small-batch forward, forward context, attention backends and host-to-device transfers."""
