# Dynamic padding: like pad, but rows are padded only to the longest piece of the batch.
out_dir = "out-dynamic_pad"
batching = "dynamic_pad"
