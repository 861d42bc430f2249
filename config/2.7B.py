# The older "2.7B" preset: the same shape as "xl" (3.4B parameters at V=10k), so this file takes
# config/xl.py whole and changes only the output directory.
#   torchrun --standalone --nproc_per_node=4 train.py config/2.7B.py
import os as _os

with open(_os.path.join(_os.path.dirname(__file__), "xl.py")) as _f:
    exec(_f.read())
out_dir = "out-2.7B"
