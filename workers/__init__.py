"""thinkserve.workers"""
