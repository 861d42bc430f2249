# Whole documents packed into one row with cu_seqlens, attention never crossing a document (add --pack_static=True
# for a few static shapes, which --cuda_graphs=True needs)
#   python train.py config/pack.py        or on a GPU: python train.py config/small.py config/pack.py
out_dir = "out-pack"
batching = "pack"
