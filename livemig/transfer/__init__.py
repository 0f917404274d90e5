"""livemig.transfer"""
