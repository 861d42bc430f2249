# The padding baseline: one document piece per row, every row padded to context_length; the loss
# ignores pads (targets -100). The same real-token budget as pack, so it costs more rows per step.
out_dir = "out-pad"
batching = "pad"
