"""livemig.comm"""
