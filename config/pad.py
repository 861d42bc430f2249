# One document piece per row, padded to context_length (targets -100 on the padding)
#   python train.py config/pad.py
out_dir = "out-pad"
batching = "pad"
