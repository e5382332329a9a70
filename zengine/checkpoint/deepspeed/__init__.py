"""DeepSpeed 0.19's ZeRO checkpoints read and written without DeepSpeed (see ``checkpoint/``)."""
