"""Learning anchors from dense prefills without slowing serving: the learner, its steps on the
idle scheduler, and the serving activity it yields to."""
