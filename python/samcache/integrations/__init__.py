"""samcache inside other engines. Each subpackage plugs into one engine through that engine's own
public interfaces and imports it lazily: importing ``samcache`` never imports an engine."""
