"""The ComfyUI bridge: what makes the worker pool look like ComfyUI to ComfyUI; runs in the ComfyUI process.

The node classes (one module per node family, in ``nodes/``) are thin: they convert their inputs and call the
engine. Everything else that ComfyUI meets lives here:

* ``pool_model`` / ``pool_patches``: ComfyUI's MODEL over the pool's transformer, and ComfyUI's model patches on it
  (what runs on the pool, what runs in ComfyUI, what is refused);
* ``comfy_sampling``: ComfyUI's own samplers on that MODEL for the WanMesh Sampler;
* ``convert`` and ``conditioning_keys``: ComfyUI's IMAGE, LATENT and CONDITIONING types, and which conditioning keys
  of which Wan model class WanMesh takes;
* ``input_checks`` and ``prompt_checks``: queue-time checks of widget values and of a prompt's files;
* ``errors``, ``memory``, ``shutdown``: failures as ComfyUI shows them, its unload / free-memory requests, its exit;
* ``runtime`` and ``files``: the handles that travel between nodes, and ComfyUI's model folders.
"""
