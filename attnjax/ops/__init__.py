"""Layer 0, pure functions on arrays: attention (and the kernel that runs it), masks, positional
encodings, the convolution the conv models use, the VQGAN's losses. Nothing here imports a
module above it."""
