# Like pad, but rows are padded only to the longest piece of the batch
#   python train.py config/dynamic_pad.py
out_dir = "out-dynamic_pad"
batching = "dynamic_pad"
