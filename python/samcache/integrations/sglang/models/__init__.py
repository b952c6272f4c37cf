"""samcache's model overrides, registered over SGLang's own classes (``ModelRegistry.register(
"samcache.integrations.sglang.models", overwrite=True)``): each module's ``EntryClass`` subclasses
SGLang's model class of the same name and adds image-KV reuse to its extend forward."""
