# Dynamic padding (SPEC §5.7): like pad, but rows are padded only to the longest piece of the batch.
out_dir = "out-dynamic_pad"
batching = "dynamic_pad"
