"""Generative metrics on features of images: FID, Inception Score, precision and recall, KID.

- ``statistics``: the mean and covariance of any number of feature vectors, accumulated in
  float64 batch by batch; the Frechet distance between two such Gaussians as pytorch-fid computes
  it; its ``.npz`` of ``mu`` and ``sigma``, read and written.
- ``scores``: the Inception Score (torch-fidelity's shuffled splits), precision and recall
  (k-nearest-neighbour manifolds, k = 3) and the Kernel Inception Distance.
- ``ssim``: structural similarity, as scikit-image's with Gaussian weights, in JAX.
- ``features``: any feature function run over batches of images, jit-compiled once and split
  over the devices, with a progress bar.
- ``sources``: where images come from: a folder of image files, a statistics ``.npz``, or a
  TFDS split (``tfds:cifar10:test``).

The network is a parameter: ``attnjax.models.inception`` gives pytorch-fid's Inception, and any
other function of images (a classifier's pre-logits) gives a domain FID. The command is
``python -m attnjax.fid``.
"""
