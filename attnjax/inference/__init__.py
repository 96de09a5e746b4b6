"""Layer 5, trained runs put to use: ``generate`` (the sampling command) and ``export``
(``jax.export`` artefacts and their torch-free loader)."""
