/* A CPU-only stand-in for the NVIDIA driver's libcuda.so.1: every entry returns CUDA_ERROR_NO_DEVICE (100), so
   vLLM's CUDA extensions can be loaded (their torch ops registered) on a machine without a driver. */
#define E 100
typedef int CUresult;
CUresult cuInit(unsigned f){return E;}
CUresult cuDriverGetVersion(int*v){if(v)*v=0;return E;}
CUresult cuDeviceGetCount(int*c){if(c)*c=0;return E;}
CUresult cuCtxGetCurrent(void**c){return E;}
CUresult cuCtxSetCurrent(void*c){return E;}
CUresult cuDeviceGetAttribute(int*v,int a,int d){return E;}
CUresult cuDevicePrimaryCtxRetain(void**c,int d){return E;}
CUresult cuGetErrorString(CUresult e,const char**s){if(s)*s="no device (CPU stand-in libcuda)";return 0;}
CUresult cuGetProcAddress_v2(const char*s,void**p,int v,unsigned long long f,void*st){if(p)*p=0;return E;}
CUresult cuGetProcAddress(const char*s,void**p,int v,unsigned long long f){if(p)*p=0;return E;}
CUresult cuMemAddressFree(unsigned long long p,unsigned long s){return E;}
CUresult cuMemAddressReserve(unsigned long long*p,unsigned long s,unsigned long a,unsigned long long addr,unsigned long long f){return E;}
CUresult cuMemCreate(unsigned long long*h,unsigned long s,const void*prop,unsigned long long f){return E;}
CUresult cuMemGetAllocationGranularity(unsigned long*g,const void*prop,int o){return E;}
CUresult cuMemMap(unsigned long long p,unsigned long s,unsigned long o,unsigned long long h,unsigned long long f){return E;}
CUresult cuMemRelease(unsigned long long h){return E;}
CUresult cuMemSetAccess(unsigned long long p,unsigned long s,const void*d,unsigned long c){return E;}
CUresult cuMemUnmap(unsigned long long p,unsigned long s){return E;}
CUresult cuPointerGetAttribute(void*d,int a,unsigned long long p){return E;}
CUresult cuTensorMapEncodeTiled(void*t,int dt,unsigned r,void*g,const void*a,const void*b,const void*c,const void*d,int e,int f,int g2,int h){return E;}
/* Added for this project: the entry points Triton 3.x's CUDA driver utilities (triton/backends/nvidia/driver.c,
   compiled by Triton into its cache as cuda_utils.so) link, which vLLM 0.31's Qwen3.5 module loads at import (its
   flash-linear-attention ops ask triton.runtime.driver.active for the target). tests/test_card_matrix.py checks that
   every cu* symbol the compiled cuda_utils.so needs is here. */
CUresult cuCtxGetDevice(int*d){return E;}
CUresult cuCtxGetLimit(unsigned long*v,int l){return E;}
CUresult cuCtxSetLimit(int l,unsigned long v){return E;}
CUresult cuDeviceGet(int*d,int o){return E;}
CUresult cuFuncGetAttribute(int*v,int a,void*f){return E;}
CUresult cuFuncSetAttribute(void*f,int a,int v){return E;}
CUresult cuFuncSetCacheConfig(void*f,int c){return E;}
CUresult cuModuleGetFunction(void**f,void*m,const char*n){return E;}
CUresult cuModuleLoadData(void**m,const void*i){return E;}
CUresult cuModuleUnload(void*m){return E;}
CUresult cuStreamIsCapturing(void*s,int*c){if(c)*c=0;return E;}
CUresult cuLaunchKernelEx(const void*c,void*f,void**p,void**e){return E;}
CUresult cuLaunchKernel(void*f,unsigned gx,unsigned gy,unsigned gz,unsigned bx,unsigned by,unsigned bz,unsigned s,void*st,void**p,void**e){return E;}
CUresult cuOccupancyMaxActiveClusters(int*n,void*f,const void*c){return E;}
