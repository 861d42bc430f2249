# Padding-free batches: whole documents (pieces of at most context_length tokens) packed into one row
# with cu_seqlens, batch_size * context_length real tokens per micro-batch; attention never crosses a document.
#   python train.py config/pack.py                      # CPU default model
#   python train.py config/small.py config/pack.py      # on a GPU (flash_attn_varlen)
# Matters on corpora of short documents (python data/prepare.py tinystories, then --dataset=tinystories): the
# Shakespeare documents are whole works, so nearly every piece is a full context_length window there.
# Add --pack_static=True for a few static batch shapes (compiled without dynamic shapes; --cuda_graphs=True then
# works too): each micro-batch padded to (batch_size + 1) * context_length tokens, the padding without targets.
out_dir = "out-pack"
batching = "pack"
