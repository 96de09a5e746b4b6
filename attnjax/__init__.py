"""attnjax: attention, ViT and VQGAN + transformer prior in pure functional Flax.

Modules are imported explicitly (``from attnjax import attention``) so that importing the
package stays cheap and never touches torch.
"""

__version__ = "0.1.0"
