"""Weight conversion between PyTorch and attnjax; the only package of attnjax that touches torch."""
