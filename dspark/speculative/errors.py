class DrafterUnavailable(RuntimeError):
    """The drafter could not answer this step (slow, gone, or lost a request's context).

    The speculative loop reacts by verifying no drafts this step (plain decoding), never by
    failing a request; speculation resumes once the drafter answers again.
    """
