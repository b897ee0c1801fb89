"""Device operations that belong to one method: module `<op>.py` registers the operation
`<op>` with `devices.ops.register`; a device imports it by that name on first use."""
